"""Rank bodies for tests/test_sharded.py (module level: the pool pickles them by reference)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from wrapperroute import GradSyncError, RouteValueError, check_grad_sync, guard, route_loss, token_divisor
from wrapperroute.check.models import TinyCausalLM, TinyConfig

CONFIG = TinyConfig()
IGNORE = -100


class FusedHeadLM(TinyCausalLM):
    """TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``) in miniature: the forward runs the backbone,
    then reads ``lm_head.weight`` itself, never calling the head, and gathers a ``DTensor`` head whole as TRL does
    (``read``: ``full_tensor()``, or a ``redistribute`` to ``Replicate``). Returns the cross-entropy summed over
    the valid tokens."""

    read = "full_tensor"

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        hidden = super().forward(input_ids)
        if labels is None:  # the backbone alone
            return hidden
        weight: Any = self.lm_head.weight
        if hasattr(weight, "full_tensor"):
            if self.read == "full_tensor":
                weight = weight.full_tensor()
            else:
                from torch.distributed.tensor import Replicate

                weight = weight.redistribute(placements=[Replicate()] * weight.device_mesh.ndim).to_local()
        logits = hidden.flatten(0, 1) @ weight.t()
        return F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE, reduction="sum")


def fused_model(read: str = "full_tensor") -> FusedHeadLM:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = FusedHeadLM(CONFIG)
    model.read = read
    return model


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step``: a different number of valid tokens on every rank and step."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, CONFIG.vocab, (2, CONFIG.seq), generator=generator)
    labels = ids.clone()
    labels[:, : 1 + (rank + step) % (CONFIG.seq - 2)] = IGNORE  # padding, uneven
    return ids, labels


def shard(model: Any, layout: str) -> None:
    """Every block its own FSDP2 unit; the head its own (``head_unit``; ``head_keep``: not resharding after its
    forward), in the root's group (``root``), or grouped with the last block and kept unsharded after its forward
    (``tail``, accelerate's grouped tail); the root resharding after its forward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    blocks = list(model.blocks)
    for block in blocks[:-1] if layout == "tail" else blocks:
        fully_shard(block, mesh=mesh)
    if layout in ("head_unit", "head_keep"):
        fully_shard(model.lm_head, mesh=mesh, reshard_after_forward=layout == "head_unit")
    elif layout == "tail":
        fully_shard([blocks[-1], model.lm_head], mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)


def one_process_grads(step: int, read: str) -> dict[str, torch.Tensor]:
    """The gradients of the mean over every valid token of the step's global batch, in one process."""
    reference = fused_model(read)
    batches = [batch(rank, step) for rank in range(dist.get_world_size())]
    total = sum(int((labels != IGNORE).sum()) for _, labels in batches)
    for ids, labels in batches:
        (reference(ids, labels) / total).backward()
    return {name: param.grad.detach().clone() for name, param in reference.named_parameters()}  # type: ignore[union-attr]


def full_grads(model: Any) -> dict[str, torch.Tensor]:
    return {name: param.grad.full_tensor().detach().clone() for name, param in model.named_parameters()}


def step_loss(model: Any, ids: torch.Tensor, labels: torch.Tensor, routed: bool) -> torch.Tensor:
    """The fused-head loss as written (the model's own forward), or routed: inside the root's forward, the head's
    unit gathered around it (found as the output embedding)."""
    if routed:
        return route_loss(model, model, lambda: FusedHeadLM.forward(model, ids, labels))
    return model(ids, labels)  # type: ignore[no-any-return]


def arrivals(layout: str, read: str, routed: bool) -> None:
    """One step of the fused-head model under FSDP2, the loss over ``token_divisor``: ``check_grad_sync`` (called
    once before the backward, to watch it) names every gradient that bypassed FSDP2's reduce-scatter, and that
    gradient is off one process on the global batch while every other is exact; ``guard`` raises on the next."""
    rank = dist.get_rank()
    model = fused_model(read)
    shard(model, layout)
    before = check_grad_sync(model)
    assert before.in_sync and not before.bypassed and not before.verified, before
    ids, labels = batch(rank, 0)
    divisor = token_divisor(model, int((labels != IGNORE).sum()))
    (step_loss(model, ids, labels, routed) / divisor).backward()
    report = check_grad_sync(model)
    grads, reference = full_grads(model), one_process_grads(0, read)
    diffs = {name: float((grads[name] - reference[name]).abs().max()) for name in reference}
    how = "routed" if routed else "as written"
    said = f"bypassed {[b.name for b in report.bypassed]}, verified {report.verified}"
    print(f"\nrank {rank} {layout}/{read}/{how}: {said}; off one process: {max(diffs.values()):.3g} "
          f"({max(diffs, key=diffs.__getitem__)})")  # fmt: skip
    bypassing = layout in ("head_unit", "head_keep") and not routed
    names = [bypass.name for bypass in report.bypassed]
    if bypassing:
        assert names == ["lm_head.weight"] and not report.in_sync, report.table()
        assert report.bypassed[0].ranks == (0, 1) and "reduce-scatter" in report.bypassed[0].how, report.bypassed
        assert diffs["lm_head.weight"] > 1e-3, f"the bypassed gradient is right after all: {diffs}"
        assert max(diff for name, diff in diffs.items() if name != "lm_head.weight") <= 1e-6, diffs
        assert report.verified == len(diffs) - 1, report.verified
    else:
        assert not names and report.in_sync, report.table()
        assert report.verified == len(diffs), (report.verified, len(diffs))
        assert max(diffs.values()) <= 1e-6, diffs
    for param in model.parameters():
        param.grad = None
    raised = None
    ids, labels = batch(rank, 1)
    with guard(model):
        try:
            step_loss(model, ids, labels, routed).backward()
        except GradSyncError as error:
            raised = str(error)
    if bypassing:
        assert raised is not None and "lm_head.weight" in raised and "route_loss" in raised, raised
    else:
        assert raised is None, raised


def guard_warns_once() -> None:
    """``guard(on_error="warn")`` on a bypass: one warning per backward, and the step completes."""
    rank = dist.get_rank()
    model = fused_model()
    shard(model, "head_unit")
    with warnings.catch_warnings(record=True) as caught, guard(model, on_error="warn"):
        warnings.simplefilter("always")
        for step in range(2):
            ids, labels = batch(rank, step)
            model(ids, labels).backward()
    said = [w for w in caught if "reduce-scatter" in str(w.message)]
    assert len(said) == 2, [str(w.message) for w in caught]


def losses_refuse_the_fsdp_shard() -> None:
    """``wrapperroute.losses`` on a head in its own FSDP2 unit, read outside that unit's forward: the same clear
    error on every rank (no collective first, no hang); routed with the head gathered, the loss runs and is exact."""
    from wrapperroute.losses import linear_cross_entropy, linear_logprobs

    rank = dist.get_rank()
    model = fused_model()
    shard(model, "head_unit")
    ids, labels = batch(rank, 0)
    hidden = model(ids).flatten(0, 1).detach()  # the backbone through the root; the head read outside its unit
    for loss in (linear_cross_entropy, linear_logprobs):
        try:
            loss(hidden, model.lm_head.weight, labels.flatten())
        except RouteValueError as error:
            said = str(error)
        else:
            raise AssertionError(f"{loss.__name__} took FSDP's shard of lm_head.weight as a vocabulary slice")
        assert "FSDP" in said and "route_loss" in said and "gather=" in said, said

    def fused() -> torch.Tensor:
        hidden = TinyCausalLM.forward(model, ids).flatten(0, 1)
        return linear_cross_entropy(hidden, model.lm_head.weight, labels.flatten(), reduction="sum")

    count = int((labels != IGNORE).sum())
    (route_loss(model, model, fused, gather=[model.lm_head]) / token_divisor(model, count)).backward()
    reference = one_process_grads(0, "full_tensor")
    grads = full_grads(model)
    worst = max(float((grads[name] - reference[name]).abs().max()) for name in reference)
    assert worst <= 1e-6, worst


def zero3_hand_gather(hold: bool) -> dict[str, Any]:
    """A loss reading ZeRO-3's head partition gathered by hand (``deepspeed.zero.GatheredParameters``) outside
    the engine's forward. ``hold``: the gather held through the backward. Returns what happened: the error, or
    the head gradient's difference from one process."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    rank = dist.get_rank()
    model = fused_model()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}, "gradient_clipping": 0,
              "zero_allow_untested_optimizer": True, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    ids, labels = batch(rank, 0)
    count = int((labels != IGNORE).sum())
    divisor = token_divisor(engine, count)
    head = engine.module.lm_head.weight
    outside = tuple(head.shape)
    hidden = engine(ids)  # the backbone through the engine, the head read by hand
    error = None
    try:
        with deepspeed.zero.GatheredParameters([head]):
            loss = F.cross_entropy(hidden.flatten(0, 1) @ head.t(), labels.flatten(), ignore_index=IGNORE,
                                   reduction="sum") / divisor  # fmt: skip
            if hold:
                engine.backward(loss)
        if not hold:
            engine.backward(loss)
    except RuntimeError as raised:
        error = str(raised)
    diff = None
    if error is None:
        reference = one_process_grads(0, "full_tensor")["lm_head.weight"]
        diff = float((safe_get_full_grad(head) - reference).abs().max())
    return {"outside": outside, "error": error, "diff": diff}
