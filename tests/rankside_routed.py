"""Rank bodies for tests/test_routed.py: ``@routed`` on plain functions, methods and a real HF ``Trainer``
subclass under DDP (module level: the pool pickles them by reference). Everything is built locally (a tiny
Llama from a config, a WordLevel tokenizer): nothing is downloaded.

Gradient truth is the upstream measurement: after one training step, every parameter's gradient is compared
across ranks (one all-gather, ``ranklib.measure``); the ranks see different data. Each body asserts it there.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranklib import measure, shifted_fused_ce
from torch.nn.parallel import DistributedDataParallel as DDP

from wrapperroute.check.models import TinyConfig, build_model
from wrapperroute.check.trl_cells import lm_rows, tiny_llama, training_args
from wrapperroute.check.trl_layouts import GradProbe, whole_grads
from wrapperroute.decorators import routed

# --- @routed on plain functions and methods, DDP over the embedded tiny LM ----------------------------------


routed_fused_ce = routed(shifted_fused_ce)


class _Loop:
    """A trainer-shaped object: ``compute_loss(self, model, inputs)``."""

    @routed
    def compute_loss(self, model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return shifted_fused_ce(model, inputs["input_ids"])

    @routed(model_arg="student")
    def distill(self, teacher: Any, student: Any, ids: torch.Tensor) -> torch.Tensor:
        return shifted_fused_ce(student, ids)


class _Plain:
    def compute_loss(self, model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return shifted_fused_ce(model, inputs["input_ids"])


def routed_functions_ddp() -> None:
    """Each way of calling a routed loss under DDP: 0 differ, bit-equal; the undecorated function: all differ
    (the bug shows). The body sees the unwrapped model, not DDP."""
    config = TinyConfig()
    ids = torch.randint(0, config.vocab, (2, config.seq), generator=torch.Generator().manual_seed(dist.get_rank()))
    loop = _Loop()
    calls: dict[str, Callable[[DDP], torch.Tensor]] = {
        "undecorated": lambda ddp: shifted_fused_ce(ddp.module, ids),
        "function": lambda ddp: routed_fused_ce(ddp, ids),
        "function_kw": lambda ddp: routed_fused_ce(ids=ids, model=ddp),
        "bound_method": lambda ddp: loop.compute_loss(ddp, {"input_ids": ids}),
        "unbound_method": lambda ddp: _Loop.compute_loss(loop, ddp, {"input_ids": ids}),
        "model_arg": lambda ddp: loop.distill(None, ddp, ids),
        "decorated_bound": lambda ddp: routed(_Plain().compute_loss)(ddp, {"input_ids": ids}),
    }
    seen = routed(lambda model: type(model).__name__)(DDP(build_model(config)))
    assert seen == "TinyCausalLM", f"the routed body saw a {seen}, not the unwrapped model"
    for name, call in calls.items():
        model = build_model(config)
        ddp = DDP(model)
        call(ddp).backward()
        cell = measure(whole_grads(model))
        if name == "undecorated":
            assert cell["differ"] == cell["params"] > 0, f"the undecorated loss must show the bug: {cell}"
        else:
            assert cell["differ"] == 0 and cell["max_diff"] == 0.0, f"{name}: gradients differ across ranks: {cell}"


# --- HF Trainer with @routed --------------------------------------------------------------------------------


def _lm_rows(rows: int, seq: int) -> list[dict[str, list[int]]]:
    return [{"input_ids": row, "labels": row} for row in lm_rows(rows, seq)]


def _trainer_body(self: Any, model: Any, inputs: dict[str, torch.Tensor], return_outputs: bool = False,
                  num_items_in_batch: Any = None) -> Any:  # fmt: skip
    """A fused-loss ``compute_loss``: unwraps the model and reads ``lm_head.weight`` itself."""
    inner = self.accelerator.unwrap_model(model)
    hidden = inner.model(input_ids=inputs["input_ids"]).last_hidden_state
    logits = hidden[:, :-1] @ inner.lm_head.weight.t()
    loss = F.cross_entropy(logits.flatten(0, 1).float(), inputs["labels"][:, 1:].flatten())
    return (loss, None) if return_outputs else loss


def hf_trainer_routed(decorated: bool) -> None:
    """One step of an HF ``Trainer`` subclass whose ``compute_loss`` reads ``lm_head.weight`` itself, under DDP:
    ``@routed``, bit-equal gradients across ranks; undecorated, every gradient differs (the bug shows)."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    class FusedLossTrainer(Trainer):
        compute_loss = routed(_trainer_body) if decorated else _trainer_body

    probe = GradProbe()
    with tempfile.TemporaryDirectory() as out:
        trainer = FusedLossTrainer(
            model=tiny_llama(64, 16),
            args=training_args(TrainingArguments, out, remove_unused_columns=False),
            train_dataset=Dataset.from_list(_lm_rows(8, 8)),
            callbacks=[probe],  # type: ignore[list-item]
        )
        trainer.train()
    wrapper = type(trainer.model_wrapped).__name__
    assert wrapper == "DistributedDataParallel", f"the Trainer wrapped the model in {wrapper}"
    cell = measure(probe.grads)
    if decorated:
        assert cell["differ"] == 0 and cell["max_diff"] == 0.0, f"@routed compute_loss: gradients differ: {cell}"
    else:
        assert cell["differ"] == cell["params"] > 0, f"the undecorated compute_loss must show the bug: {cell}"
