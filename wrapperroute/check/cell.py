"""One cell of the check matrix, run on every rank: a wrapper, a loss, routed or not, some steps.

Gradient truth: after each step every parameter's full gradient is compared (1) across ranks, by one
all-gather, and (2) against a single process that computes the same loss on the concatenated global batch
from identical initial weights. Routed cells must show 0 parameters differing and a tiny reference error;
unrouted cells show what the bug does.

A token-level loss is a sum over its valid tokens divided by :func:`wrapperroute.token_divisor` of the step's
count, and its batches hold different numbers of valid tokens on every rank and micro-batch: the reference is
the mean over every valid token of every micro-batch of the global batch. ``normalise="rank_mean"`` runs the
same batches with each rank's own mean instead, the objective the divisor replaces.
"""

from __future__ import annotations

import contextlib
import math
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from .._groups import group_ranks
from .._routing.state import forget_isolated, routing_state
from .._torch_internals import reset_dynamo
from ..arrivals import Watch
from ..crossrank import Row, compare
from ..detect import detect
from ..route import Mode, route_loss
from ..tokens import token_divisor
from .losses import LOSSES, Batch, LossCase, make_batch
from .models import TinyConfig, build_model
from .wrappers import WRAPPERS, build_none

# Two gradients count as "different across ranks" above this; DDP's all-reduce makes them bit-identical.
RANK_TOLERANCE = 0.0
# The most a routed fp32 gradient may differ from one process on the concatenated global batch.
REFERENCE_TOLERANCE = 1e-6


@dataclass
class Cell:
    wrapper: str = "ddp"
    loss: str = "fused_ce"
    routed: bool = True
    mode: Mode = "auto"
    steps: int = 1
    accum: int = 1  # micro-batches per step; all but the last under the wrapper's no_sync
    wrapper_opts: dict[str, Any] = field(default_factory=dict)
    config: TinyConfig | None = None  # default: the loss's own
    rows: int = 2
    fresh_compile: bool = False  # drop Dynamo's caches first, so a compiled loss is compiled inside the wrapper
    # a token-level loss: its sum over token_divisor ("divisor"), or each rank's own mean ("rank_mean")
    normalise: Literal["divisor", "rank_mean"] = "divisor"

    def label(self) -> str:
        how = f"routed[{self.mode}]" if self.routed else "unrouted"
        opts = ",".join(f"{k}={v}" for k, v in sorted(self.wrapper_opts.items()))
        mean = ", per-rank mean" if self.normalise == "rank_mean" and LOSSES[self.loss].summed else ""
        return f"{self.wrapper}{'(' + opts + ')' if opts else ''} / {self.loss} / {how}{mean}"


@dataclass
class CellResult:
    label: str
    rank: int
    params: int = 0
    differ: int = 0  # parameters whose gradient differs across ranks (worst step)
    max_rank_diff: float = 0.0
    max_ref_diff: float = 0.0  # max |grad - single-process reference| (worst step)
    losses: list[float] = field(default_factory=list)
    fell_back: bool = False  # the functorch fallback engaged during this cell
    bypassed: list[str] = field(default_factory=list)  # sharded gradients that arrived around the reduction
    error: str | None = None
    seconds: float = 0.0


def is_exact(cell: CellResult) -> bool:
    """No error, no gradient differing across ranks or around its wrapper's reduction, within the reference
    tolerance."""
    return cell.error is None and cell.differ == 0 and not cell.bypassed and cell.max_ref_diff <= REFERENCE_TOLERANCE


def differing_across_ranks(grads: dict[str, torch.Tensor]) -> tuple[int, float]:
    """(parameters differing across ranks, the largest difference), every tensor gathered whole: exact."""
    world = group_ranks(None)
    outcome = compare([Row(name, grad, world) for name, grad in sorted(grads.items())], whole=True)
    diffs = [math.inf if m.nonfinite else m.max_abs_diff for m in outcome.mismatches]
    return sum(diff > RANK_TOLERANCE for diff in diffs), max(diffs, default=0.0)


def abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|, in float64; inf where either holds NaN or inf: a non-finite gradient is never exact (and
    Python's ``max(0.0, nan)`` is 0.0, so a NaN would otherwise vanish from a running maximum)."""
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return math.inf
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def max_grad_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest difference between two sets of gradients, over ``b``'s names (a step against its reference)."""
    return max(abs_diff(a[n], b[n]) for n in b)


def _shard(batch: Batch, shard: tuple[int, int] | None) -> Batch:
    """This rank's part of each sequence under context parallelism (``(index, parts)``), else the batch."""
    if shard is None:
        return batch
    index, parts = shard
    return {key: value.chunk(parts, dim=1)[index] for key, value in batch.items()}


def run_cell(cell: Cell) -> CellResult:
    """Run ``cell`` on this rank; every rank must call it. Errors inside the step are reported, not raised,
    when every rank hits them at the same point (the crash reproductions)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    result = CellResult(cell.label(), rank)
    start = time.perf_counter()
    case = LOSSES[cell.loss]
    config = cell.config or case.config
    if cell.fresh_compile:
        reset_dynamo()
        forget_isolated()

    wrapper_case = WRAPPERS[cell.wrapper]
    opts = dict(cell.wrapper_opts)
    if wrapper_case.accumulation_option is not None:  # DeepSpeed accumulates micro-batches itself
        opts.setdefault(wrapper_case.accumulation_option, cell.accum)
    wrapped = wrapper_case.build(build_model(config), opts)
    watch = watch_sharded(wrapped.model)
    extras = case.extras(config)
    reference = build_none(wrapped.twin if wrapped.twin is not None else build_model(config), {})
    # under tensor parallelism the ranks of one group read one batch: batches go by data-parallel replica
    data_rank = rank if wrapped.data_rank is None else wrapped.data_rank
    data_world = world if wrapped.data_world is None else wrapped.data_world
    reference_extras = case.extras(config)
    by_tokens = case.summed is not None and cell.normalise == "divisor"
    isolated_before = routing_state().isolated
    for step in range(cell.steps):
        micro_batches = [_shard(make_batch(case, config, data_rank, step, micro, cell.rows, True), wrapped.seq_shard)
                         for micro in range(cell.accum)]  # fmt: skip
        try:
            # the step's count first, on every rank: the divisor of every micro-batch's summed loss
            divisor = token_divisor(wrapped.model, sum(map(case.count, micro_batches))) if by_tokens else None  # type: ignore[arg-type]
            for micro, batch in enumerate(micro_batches):
                last = micro == cell.accum - 1
                with contextlib.nullcontext() if last else wrapped.no_sync():
                    loss = _loss(cell, case, wrapped.model, wrapped.inner, batch, extras, divisor)
                    wrapped.backward(loss)
                result.losses.append(float(loss.detach()))
        except Exception:
            result.error = traceback.format_exc(limit=-8)
            break
        if watch is not None:
            result.bypassed += [name for name in watch.look()[1] if name not in result.bypassed]
        grads = wrapped.full_grads()
        differ, rank_diff = differing_across_ranks(grads)

        globals_ = [case.concat([make_batch(case, config, r, step, micro, cell.rows, True) for r in range(data_world)])
                    for micro in range(cell.accum)]  # fmt: skip
        total = sum(map(case.count, globals_)) if case.count is not None else 0
        for batch in globals_:
            if case.summed is not None:  # the mean over every valid token of the step's global batch
                ref_loss = case.summed(reference.model, batch, reference_extras) / total  # type: ignore[arg-type]
            else:  # a mean over sequences: every micro-batch holds as many on every rank
                ref_loss = case.compute(reference.model, batch, reference_extras) * wrapped.loss_scale  # type: ignore[arg-type]
            ref_loss.backward()
        ref_grads = reference.full_grads()

        result.params = len(grads)
        result.differ = max(result.differ, differ)
        result.max_rank_diff = max(result.max_rank_diff, rank_diff)
        result.max_ref_diff = max(result.max_ref_diff, max_grad_diff(grads, ref_grads))
        wrapped.step()
        reference.step()
    result.fell_back = bool(routing_state().isolated - isolated_before)
    result.seconds = time.perf_counter() - start
    return result


def watch_sharded(model: Any) -> Watch | None:
    """The wrapper's sharded gradients watched from now on (arrivals.py), where it assigns them itself."""
    found = detect(model)
    if found.adapter is None or found.wrapper is None:
        return None
    assigned = found.adapter.assigned_gradients(found.wrapper)
    return None if assigned is None else Watch(found.kind, assigned.reduction, assigned.params)


def _loss(
    cell: Cell, case: LossCase, model: Any, inner: Any, batch: Batch, extras: dict[str, Any], divisor: Any
) -> torch.Tensor:
    """One micro-batch's loss, routed through ``model`` or computed on ``inner`` as the bug does: the sum over
    ``divisor``, or the loss's own mean."""
    fn: Any = case.compute if divisor is None else case.summed
    if cell.routed:
        loss = route_loss(model, inner, fn, inner, batch, extras, mode=cell.mode)
    else:
        loss = fn(inner, batch, extras)
    return loss if divisor is None else loss / divisor
