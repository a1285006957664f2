"""Prove gradients are in sync: ``check_grad_sync`` after a backward, and ``guard`` during training."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from .detect import detect
from .errors import GradSyncError, RouteStateError


@dataclass(frozen=True)
class SyncReport:
    """What :func:`check_grad_sync` compared and found."""

    kind: str
    compared: int  # parameters compared across ranks
    differing: int  # of those, how many differ on some rank
    max_abs_diff: float
    worst: tuple[tuple[str, float], ...] = field(default=())  # (name, max abs diff), worst first
    note: str = ""

    @property
    def in_sync(self) -> bool:
        return self.differing == 0

    def table(self) -> str:
        """The upstream report's table: parameters differing across ranks and the largest difference."""
        lines = [
            f"{'wrapper':<10} {'params differing':>18} {'max abs diff':>13}",
            f"{self.kind:<10} {f'{self.differing} / {self.compared}':>18} {self.max_abs_diff:>13.3g}",
        ]
        lines += [f"  {name}: {diff:.3g}" for name, diff in self.worst]
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def check_grad_sync(model: nn.Module, *, group: dist.ProcessGroup | None = None, top: int = 5) -> SyncReport:
    """Compare every parameter's gradient across the ranks of ``group``; call on every rank after backward.

    Cheap by default: one all-gather of two float64 checksums per parameter; only parameters whose checksums
    differ are gathered in full to measure the difference. Replicated wrappers (DDP, composable ``replicate``
    and its FSDP2-based form, or no wrapper) must hold identical gradients. Sharded wrappers (FSDP1/2, DeepSpeed)
    hold a different shard on each rank by design,
    so their local gradients are not compared; the report says so (a sharded loss computed outside the
    wrapper fails loudly instead: 1-D shards, DTensor mixes, 0-element ZeRO-3 weights).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RouteStateError(
            "check_grad_sync needs an initialised process group (torch.distributed.init_process_group); "
            "in a single process there is nothing to compare"
        )
    found = detect(model)
    if found.adapter is not None and found.adapter.shards:
        return SyncReport(
            found.kind, 0, 0, 0.0, note=f"{found.kind} shards gradients: local shards differ by design, not compared"
        )
    named = [(n, p) for n, p in found.inner.named_parameters() if p.requires_grad]
    grads = [(n, _local(p.grad.detach() if p.grad is not None else torch.zeros_like(p))) for n, p in named]
    diffs = sorted(compare_across_ranks(grads, group=group), key=lambda item: -item[1])
    differing = sum(1 for _, d in diffs if d > 0)
    return SyncReport(
        found.kind, len(named), differing, diffs[0][1] if diffs else 0.0, tuple(d for d in diffs[:top] if d[1] > 0)
    )


def compare_across_ranks(
    grads: list[tuple[str, torch.Tensor]], *, group: dist.ProcessGroup | None = None, whole: bool = False
) -> list[tuple[str, float]]:
    """``(name, max abs difference across the ranks of group)`` for each tensor of ``grads`` (in order, the
    same names on every rank); every rank calls it. By default one all-gather of two float64 checksums per
    tensor (sum and sum of squares), then only the tensors whose checksums differ are gathered whole to measure
    the difference; the others count 0. ``whole=True`` gathers every tensor whole (the test suite's exact
    comparison: no pair of differing tensors can share both checksums)."""
    world = dist.get_world_size(group)
    if whole:
        suspects = list(range(len(grads)))
    else:
        checksums = (
            torch.stack([torch.stack([g.double().sum(), g.double().square().sum()]) for _, g in grads])
            if grads
            else torch.zeros(0, 2, dtype=torch.float64)
        )
        gathered = [torch.empty_like(checksums) for _ in range(world)]
        dist.all_gather(gathered, checksums, group=group)
        stacked = torch.stack(gathered)
        suspects = [i for i in range(len(grads)) if not bool((stacked[:, i] == stacked[0, i]).all())]
    diffs = [0.0] * len(grads)
    if suspects:  # every rank computed the same suspect list from the same gathered checksums
        flat = torch.cat([grads[i][1].reshape(-1).float() for i in suspects])
        everyone = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(everyone, flat, group=group)
        offset = 0
        for i in suspects:
            size = grads[i][1].numel()
            pieces = [e[offset : offset + size] for e in everyone]
            diffs[i] = max(float((p - pieces[0]).abs().max()) if size else 0.0 for p in pieces)
            offset += size
    return [(name, diff) for (name, _), diff in zip(grads, diffs, strict=True)]


def _local(grad: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor's local copy (replicate built on FSDP2); any other tensor as it is."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) else grad


@contextmanager
def guard(model: nn.Module, on_error: Literal["raise", "warn"] = "raise") -> Iterator[None]:
    """Catch the silent DDP desync: gradients produced while DDP's forward did not arm the reducer.

    Inside the block, any backward that produces gradients for the DDP model's parameters must have been
    preceded (since the previous backward) by a forward through the wrapper: a normal ``model(...)`` call or
    :func:`route_loss`. Steps under ``no_sync()`` are not checked: their gradients stay local on purpose.
    Sharded wrappers need no guard: an unrouted loss fails loudly there. Cost: one Python flag check per
    parameter gradient.
    """
    if on_error not in ("raise", "warn"):
        raise RouteStateError(f"on_error must be 'raise' or 'warn', got {on_error!r}")
    found = detect(model)
    if found.kind not in ("ddp", "replicate") or found.wrapper is None:
        yield
        return
    ddp = found.wrapper
    syncs = _sync_flag(ddp, found.kind)
    state = {"armed": False, "checked": False}  # armed: forward ran since the last backward

    def on_forward(module: nn.Module, args: object, output: object) -> None:
        if torch.is_grad_enabled():
            state["armed"] = True

    def reset() -> None:
        state["armed"] = state["checked"] = False

    def on_grad(param: torch.Tensor) -> None:
        if state["checked"]:  # once per backward
            return
        state["checked"] = True
        torch.autograd.Variable._execution_engine.queue_callback(reset)
        if state["armed"] or not syncs():
            return
        reset()  # the backward may abort below, and its end-of-backward callback with it
        message = (
            f"gradients of a {type(found.inner).__name__} under {found.kind!r} were computed without "
            "DDP's forward, so they will not be all-reduced and every rank trains its own model. Compute the "
            "loss through the wrapper: wrapperroute.route_loss(model, unwrapped, loss_fn, ...)."
        )
        if on_error == "raise":
            raise GradSyncError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)

    handles = [ddp.register_forward_hook(on_forward)]
    handles += [p.register_post_accumulate_grad_hook(on_grad) for p in ddp.parameters() if p.requires_grad]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _sync_flag(wrapper: nn.Module, kind: str) -> Callable[[], bool]:
    """Whether this backward is meant to all-reduce (False under ``no_sync`` / ``set_requires_gradient_sync``)."""
    if kind == "replicate":
        from .adapters.replicate import requires_gradient_sync

        return lambda: requires_gradient_sync(wrapper)
    return lambda: bool(getattr(wrapper, "require_backward_grad_sync", True))
