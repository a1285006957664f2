"""Rank bodies for tests/test_tokens.py: ``token_divisor`` on bad counts, inside a routed loss, without a wrapper,
with a divide factor or a communication hook of the user's own, and through transformers' ``Trainer``. Each
asserts where its fact is computed; module level, so the pool pickles them by reference."""

from __future__ import annotations

import tempfile
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from wrapperroute import RouteValueError, UnroutedModelWarning, route_loss, token_divisor
from wrapperroute.check.cell import REFERENCE_TOLERANCE, max_grad_diff
from wrapperroute.check.models import TinyConfig, build_model
from wrapperroute.losses import linear_cross_entropy


def bad_counts() -> None:
    """A bad count on one rank raises on every rank, each saying what it knows; a global zero too; the group
    stays usable (the next good call returns)."""
    rank = dist.get_rank()
    ddp = DDP(build_model(TinyConfig()))
    cases: list[tuple[Any, Any, str, str]] = [
        (-3, 5, "never negative", "other rank(s)"),
        (2.5, 5, "whole number", "other rank(s)"),
        (torch.tensor(float("nan")), 5, "not a number", "other rank(s)"),
        ("many", 5, "got str", "other rank(s)"),
        (torch.ones(2), 5, "shape (2,)", "other rank(s)"),
        (True, 5, "got bool", "other rank(s)"),
        (0, torch.tensor(0), "no valid token", "no valid token"),
    ]
    for bad, good, on_bad, on_good in cases:
        mine, expected = (bad, on_bad) if rank == 1 else (good, on_good)
        try:
            token_divisor(ddp, mine)
        except RouteValueError as error:
            assert expected in str(error), (bad, str(error))
        else:
            raise AssertionError(f"no error on rank {rank} for {bad!r}")
    # an all-padding rank beside one with tokens: fine, and the group still answers
    divisor = float(token_divisor(ddp, 0 if rank == 0 else torch.tensor(6)))
    assert divisor == 3.0, f"0 and 6 tokens over 2 ranks: divisor {divisor}, not 3"


def inside_a_routed_loss() -> None:
    """The unwrapped module given inside a routed loss finds the wrapper around it: the same divisor as the
    wrapper's (here 4 + 8 tokens over 2 ranks), not this rank's own count."""
    model = build_model(TinyConfig())
    ddp = DDP(model)
    count = 4 if dist.get_rank() == 0 else 8
    outside = float(token_divisor(ddp, count))
    inside = route_loss(ddp, model, lambda m: token_divisor(m, count) + 0 * m.lm_head.weight.sum(), model)
    assert outside == 6.0 and float(inside) == 6.0, (outside, float(inside))


def without_a_wrapper() -> None:
    """No wrapper on several ranks: this rank's count, said aloud."""
    model = build_model(TinyConfig())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = float(token_divisor(model, 7 + dist.get_rank()))
    assert value == 7 + dist.get_rank(), value
    assert any(issubclass(w.category, UnroutedModelWarning) and "own count" in str(w.message) for w in caught), caught


def _user_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP reads the annotation: dist.GradBucket or none
    """A communication hook of the user's own: sums instead of averaging."""
    tensor = bucket.buffer()
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def unread_hook() -> None:
    """A DDP communication hook that is not torch's is said once, by name; torch's own are read silently."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    own = DDP(build_model(TinyConfig()))
    own.register_comm_hook(None, allreduce_hook)
    user = DDP(build_model(TinyConfig()))
    user.register_comm_hook(None, _user_hook)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        token_divisor(own, 3)
        assert not caught, [str(w.message) for w in caught]
        token_divisor(user, 3)
        token_divisor(user, 3)
    said = [str(w.message) for w in caught if "_user_hook" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]


def fsdp2_divide_factor() -> None:
    """FSDP2 with ``set_gradient_divide_factor(1.0)`` sums gradients: the divisor is the whole count, and a step
    of a summed loss over it is exact against one process's token mean."""
    from wrapperroute._torch_internals import fsdp2_api

    config = TinyConfig()
    model, reference = build_model(config), build_model(config)
    fsdp2_api().fully_shard(model)
    model.set_gradient_divide_factor(1.0)  # type: ignore[operator]
    model.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]  # gloo has no PREMUL_SUM
    batches = _uneven_batches(config)
    rank = dist.get_rank()
    divisor = token_divisor(model, _count(batches[rank]))
    total = sum(_count(batch) for batch in batches)
    assert float(divisor) == total, (float(divisor), total)
    route_loss(model, model, _summed_ce, model, batches[rank]).div(divisor).backward()
    _summed_ce(reference, {k: torch.cat([b[k] for b in batches]) for k in batches[0]}).div(total).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}  # type: ignore[union-attr]
    difference = max_grad_diff(grads, {n: p.grad for n, p in reference.named_parameters()})  # type: ignore[misc]
    assert difference <= REFERENCE_TOLERANCE, f"gradients {difference:.3g} from one process's token mean"


def _uneven_batches(config: TinyConfig) -> list[dict[str, torch.Tensor]]:
    from wrapperroute.check.losses import LOSSES, make_batch

    return [make_batch(LOSSES["vocab_ce"], config, r, 0, 0, 2, uneven=True) for r in range(dist.get_world_size())]


def _count(batch: dict[str, torch.Tensor]) -> int:
    return int((batch["labels"] != -100).sum())


def _summed_ce(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    hidden = model(batch["input_ids"]).flatten(0, 1)
    return linear_cross_entropy(hidden, model.lm_head.weight, batch["labels"].flatten(), reduction="sum")


# --- transformers' Trainer ------------------------------------------------------------------------------------

TRAINER_ROWS, TRAINER_SEQ, TRAINER_VOCAB = 8, 8, 64  # one optimizer step: 2 ranks x 2 rows x 2 micro-batches


def _trainer_rows() -> list[dict[str, list[int]]]:
    """HF-convention rows (``labels`` aligned with ``input_ids``, shifted by the loss): each row's first labels
    ignored, a different number per row (a prompt mask), so ranks and micro-batches hold different counts. The
    first is always ignored (it is no prediction's target), so the count is the same whether a release counts
    ``labels`` (before transformers 5.10) or ``labels[..., 1:]``."""
    generator = torch.Generator().manual_seed(4321)
    rows = []
    for index in range(TRAINER_ROWS):
        ids = torch.randint(4, TRAINER_VOCAB, (TRAINER_SEQ,), generator=generator)
        labels = ids.clone()
        labels[: 1 + (5 * index) % (TRAINER_SEQ - 1)] = -100
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return rows


def _shifted_sum(model: Any, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The causal-LM loss over ``labels[..., 1:]`` (what the Trainer counts), summed: ``lm_head.weight`` read
    directly."""
    hidden = model.model(input_ids=input_ids).last_hidden_state[:, :-1].flatten(0, 1)
    return linear_cross_entropy(hidden, model.lm_head.weight, labels[:, 1:].flatten(), reduction="sum")


def trainer_token_mean(layout: str, normalise: str, differs_by: float | None = None) -> None:
    """One optimizer step of a ``Trainer`` whose ``@routed`` ``compute_loss`` sums the loss over valid tokens,
    over 2 micro-batches of uneven counts; ``normalise``: ``"divisor"`` (``trainer_token_divisor``) or
    ``"num_items"`` (what an override is tempted to write: ``loss_sum / num_items_in_batch``). Compared with one
    process's mean over every valid token of the step (the whole data set): exact, or (``differs_by``) further
    from it than that, a different objective."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from wrapperroute import routed
    from wrapperroute.check.trl_cells import tiny_llama, training_args
    from wrapperroute.check.trl_layouts import GradProbe, layout_args, whole_grads
    from wrapperroute.check.trl_layouts import layout as under
    from wrapperroute.integrations.transformers import trainer_token_divisor

    class SummedLossTrainer(Trainer):
        @routed
        def compute_loss(self, model: Any, inputs: dict[str, torch.Tensor], return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:  # fmt: skip
            loss = _shifted_sum(model, inputs["input_ids"], inputs["labels"])
            if normalise == "divisor":
                return loss / trainer_token_divisor(self, num_items_in_batch)
            return loss / num_items_in_batch

    probe = GradProbe()
    rows = _trainer_rows()
    with tempfile.TemporaryDirectory() as out, under(layout, probe):
        args = training_args(TrainingArguments, out, remove_unused_columns=False, gradient_accumulation_steps=2,
                             **layout_args(layout))  # fmt: skip
        trainer = SummedLossTrainer(model=tiny_llama(TRAINER_VOCAB, 16), args=args,
                                    train_dataset=Dataset.from_list(rows), callbacks=[probe])  # fmt: skip
        trainer.train()
    reference = tiny_llama(TRAINER_VOCAB, 16)
    ids = torch.tensor([row["input_ids"] for row in rows])
    labels = torch.tensor([row["labels"] for row in rows])
    (_shifted_sum(reference, ids, labels) / int((labels[:, 1:] != -100).sum())).backward()
    difference = max_grad_diff(probe.grads, whole_grads(reference))
    what = f"{type(trainer.model_wrapped).__name__}, loss over {normalise}"
    if differs_by is None:
        assert difference <= REFERENCE_TOLERANCE, f"{what}: gradients {difference:.3g} from the global token mean"
    else:
        assert difference > differs_by, f"{what}: gradients only {difference:.3g} from the global token mean"
