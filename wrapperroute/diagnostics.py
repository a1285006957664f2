"""Prove gradients are in sync: ``check_grad_sync`` after a backward, and ``guard`` during training."""

from __future__ import annotations

import functools
import math
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from ._groups import dtensor_copies, group_ranks, initialized
from ._torch_internals import at_end_of_backward
from .adapters import ArmsInForward, Replica, Topology
from .arrivals import Arrivals, Bypass, Watch, agree
from .crossrank import Row, compare, local_part
from .detect import detect
from .errors import GradSyncError, RouteStateError, RouteValueError


@dataclass(frozen=True)
class SyncReport:
    """What :func:`check_grad_sync` compared and found."""

    kind: str
    compared: int  # parameters compared across ranks
    differing: int  # of those, how many differ on some rank (NaN beside a number differs)
    max_abs_diff: float  # the largest difference between finite values
    worst: tuple[tuple[str, float], ...] = field(default=())  # (name, max abs diff), worst first
    note: str = ""
    nonfinite: tuple[str, ...] = ()  # gradients holding NaN or inf, whether or not they differ
    verified: int = 0  # sharded gradients that came only through the wrapper's reduction since the last call
    bypassed: tuple[Bypass, ...] = ()  # sharded gradients that arrived around it (arrivals.py)

    @property
    def in_sync(self) -> bool:
        """No copy differing, and no sharded gradient around its wrapper's reduction."""
        return self.differing == 0 and not self.bypassed

    def table(self) -> str:
        """The upstream report's table: parameters differing across ranks and the largest difference."""
        lines = [
            f"{'wrapper':<10} {'params differing':>18} {'max abs diff':>13}",
            f"{self.kind:<10} {f'{self.differing} / {self.compared}':>18} {self.max_abs_diff:>13.3g}",
        ]
        lines += [f"  {name}: {diff:.3g}" for name, diff in self.worst]
        if self.nonfinite:
            shown = ", ".join(self.nonfinite[:5]) + (" ..." if len(self.nonfinite) > 5 else "")
            lines.append(f"non-finite (NaN or inf) gradients: {len(self.nonfinite)}: {shown}")
        if self.verified:
            lines.append(f"sharded gradients that came only through the wrapper's reduction: {self.verified}")
        if self.bypassed:
            lines.append(f"sharded gradients that bypassed the wrapper's reduction: {len(self.bypassed)}")
            lines += [f"  {bypass.describe()}" for bypass in self.bypassed]
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


_watches: weakref.WeakKeyDictionary[nn.Module, Watch] = weakref.WeakKeyDictionary()  # check_grad_sync's, by wrapper


def check_grad_sync(model: nn.Module, *, group: dist.ProcessGroup | None = None, top: int = 5) -> SyncReport:
    """Compare every replicated parameter's gradient with its copies on the other ranks, and check that every
    sharded one came through its wrapper's reduction; call on every rank after backward.

    Which ranks hold copies is the wrapper's to say: DDP's process group, composable ``replicate``'s (one
    dimension of a mesh, say), the replicate dimension of an FSDP2 HSDP mesh; a model with no wrapper is
    compared across every rank (a DTensor's slices among the ranks holding the same slice). Sharded parameters
    have no copies to compare. FSDP2's are watched instead (:mod:`wrapperroute.arrivals`): a gradient that
    autograd computed for a sharded parameter since the last call (a loss reading it outside its unit's forward,
    ``weight.full_tensor()``) bypassed FSDP2's reduce-scatter, and is in ``bypassed``; ``verified`` counts those
    that came through it. The first call on a model starts the watch (call it once before training to cover the
    first backward too). A read of an FSDP1 or ZeRO-3 shard outside the forward fails loudly instead (a 1-D
    shard, a 0-element partition). ``group``: compare every gradient across the ranks of this group instead.

    Cheap: two small all-gathers (the rows' layout, then one signature per gradient); only gradients whose
    signatures differ, or hold NaN or inf, are sent whole (one more) and compared as values. A gradient NaN on
    one rank and finite on another differs; NaN identical on every rank does not, and is listed in
    ``nonfinite``. A parameter with no gradient counts as zeros.
    """
    if not initialized():
        raise RouteStateError(
            "check_grad_sync needs an initialised process group (torch.distributed.init_process_group); "
            "in a single process there is nothing to compare"
        )
    found = detect(model)
    if group is not None:
        copies = group_ranks(group)
        every = [Replica(n, p, copies) for n, p in found.inner.named_parameters() if p.requires_grad]
    elif found.adapter is None:  # every rank a copy, but for a DTensor's slices (tensor parallelism alone)
        world = group_ranks(None)
        every = [Replica(n, p, dtensor_copies(p) or world, alone="sharded")
                 for n, p in found.inner.named_parameters() if p.requires_grad]  # fmt: skip
    else:
        every = found.adapter.replicas(found.wrapper)  # type: ignore[arg-type]
    arrivals, watching = _arrivals(found.adapter, found.wrapper, group)
    replicas = [r for r in every if r.compared and r.grads]
    note = _not_compared(every, replicas)
    if not replicas:
        why = "no trainable parameter" if not every else "no gradient with a copy on another rank"
        said = "; ".join(part for part in (f"{why}, nothing compared", note and f"not compared: {note}", watching)
                         if part)  # fmt: skip
        return SyncReport(found.kind, 0, 0, 0.0, note=said, verified=arrivals.verified, bypassed=arrivals.bypassed)
    rows = [Row(r.name, local_part(_grad_or_zeros(r.param)), r.copies) for r in replicas]
    outcome = compare(rows, group)
    # NaN where a non-finite value stands beside another value: no finite difference says it
    worst = tuple((m.key, math.nan if m.nonfinite else m.max_abs_diff) for m in outcome.mismatches)
    finite = [m.max_abs_diff for m in outcome.mismatches]
    nonfinite = {m.key for m in outcome.mismatches if m.nonfinite} | set(outcome.nonfinite)
    return SyncReport(
        found.kind,
        len(rows),
        len(outcome.mismatches),
        max(finite, default=0.0),
        worst[:top],
        note="; ".join(part for part in (note and f"not compared: {note}", watching) if part),
        nonfinite=tuple(sorted(nonfinite)),
        verified=arrivals.verified,
        bypassed=arrivals.bypassed,
    )


def _arrivals(adapter: Topology | None, wrapper: nn.Module | None, group: Any) -> tuple[Arrivals, str]:
    """How the wrapper's sharded gradients arrived since the last call, agreed over ``group`` (a collective, where
    the wrapper assigns such gradients: every rank holds the same model), and what the watch could not see yet."""
    assigned = adapter.assigned_gradients(wrapper) if adapter is not None and wrapper is not None else None
    if adapter is None or wrapper is None or assigned is None:
        return Arrivals(), ""  # every rank holds the same model: none of them has sharded gradients to look at
    said = ""
    watch = _watches.get(wrapper)
    if watch is None:
        watch = _watches[wrapper] = Watch(adapter.kind, assigned.reduction, assigned.params)
        if not watch.watching_since_start:
            said = (f"{len(watch)} sharded gradient(s) watched from this call on (call check_grad_sync once before "
                    "the first backward to check that one too)")  # fmt: skip
    return agree([(watch, "", watch.look())], group), said


def _not_compared(every: list[Replica], compared: list[Replica]) -> str:
    """What was not compared and why, by count: ``"4 sharded, 2 gradients partitioned"``."""
    chosen = {id(r) for r in compared}
    reasons: dict[str, int] = {}
    for replica in every:
        if id(replica) not in chosen:
            why = replica.alone or "gradient partitioned (compared as a parameter by the audit)"
            reasons[why] = reasons.get(why, 0) + 1
    return ", ".join(f"{count} {why}" for why, count in sorted(reasons.items()))


def _grad_or_zeros(param: torch.Tensor) -> torch.Tensor:
    return param.grad.detach() if param.grad is not None else torch.zeros_like(param)


@contextmanager
def guard(model: nn.Module, on_error: Literal["raise", "warn"] = "raise") -> Iterator[None]:
    """Catch, as the backward runs, a gradient that will not be reduced across ranks, silently.

    - **DDP** (and composable ``replicate``): any backward that produces gradients for the model's parameters
      must have been preceded (since the previous backward) by a forward through the wrapper: a normal
      ``model(...)`` call or :func:`route_loss`. Steps under ``no_sync()`` are not checked: their gradients
      stay local on purpose.
    - **FSDP2**: autograd must compute no gradient for a sharded parameter, which FSDP2 gives its gradient itself
      after its reduce-scatter (:mod:`wrapperroute.arrivals`): one that it does compute came from a loss reading
      the shard outside its unit's forward (``weight.full_tensor()``), around the reduction.

    A read of an FSDP1 or ZeRO-3 shard outside the forward fails loudly, and needs no guard. Cost: one Python
    flag check per parameter gradient (DDP); nothing on FSDP2's own path, where the hooks never fire.
    """
    if on_error not in ("raise", "warn"):
        raise RouteValueError(f"on_error must be 'raise' or 'warn', got {on_error!r}")
    found = detect(model)
    adapter, wrapper = found.adapter, found.wrapper
    if adapter is None or wrapper is None:
        yield
        return
    armed_in_forward = adapter if isinstance(adapter, ArmsInForward) else None
    assigned = adapter.assigned_gradients(wrapper)
    if armed_in_forward is None and assigned is None:
        yield
        return
    state = {"armed": False, "checked": False}  # armed: forward ran since the last backward

    def reset() -> None:
        state["armed"] = state["checked"] = False

    def fail(message: str) -> None:
        """Raise ``message`` (the backward aborts) or warn it, once per backward."""
        if state["checked"]:
            return
        state["checked"] = True
        at_end_of_backward(reset)
        if on_error == "raise":
            reset()  # the backward aborts here, and its end-of-backward callback with it
            raise GradSyncError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)  # once: the callback resets at the backward's end

    def on_forward(module: nn.Module, args: object, output: object) -> None:
        if torch.is_grad_enabled():
            state["armed"] = True

    def on_grad(armed: ArmsInForward, param: torch.Tensor) -> None:
        if state["checked"]:  # once per backward
            return
        if state["armed"] or not armed.syncs_gradients(wrapper):
            state["checked"] = True
            at_end_of_backward(reset)
            return
        fail(
            f"gradients of a {type(found.inner).__name__} under {found.kind!r} were computed without "
            "DDP's forward, so they will not be all-reduced and every rank trains its own model. Compute the "
            "loss through the wrapper: wrapperroute.route_loss(model, unwrapped, loss_fn, ...)."
        )

    def on_bypass(name: str, reduction: str, grad: torch.Tensor) -> None:
        fail(
            f"{name} of a {type(found.inner).__name__} under {found.kind!r} got a gradient from autograd on its "
            f"sharded parameter: the loss read it outside its unit's forward, so the gradient skips {reduction} "
            "(each rank keeps its own, consistent and wrong). Compute the loss inside the wrapper's forward: "
            f"wrapperroute.route_loss(model, unwrapped, loss_fn, ..., gather=[the module owning {name}])."
        )

    handles: list[Any] = []
    if armed_in_forward is not None:
        on_armed_grad = functools.partial(on_grad, armed_in_forward)
        handles.append(wrapper.register_forward_hook(on_forward))
        handles += [p.register_post_accumulate_grad_hook(on_armed_grad) for p in wrapper.parameters()
                    if p.requires_grad]  # fmt: skip
    if assigned is not None:
        handles += [param.register_hook(functools.partial(on_bypass, name, assigned.reduction))
                    for name, param in assigned.params]  # fmt: skip
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
