"""One cell of the check matrix, run on every rank: a wrapper, a loss, routed or not, some steps.

Gradient truth: after each step every parameter's full gradient is compared (1) across ranks, by one
all-gather, and (2) against a single process that computes the same loss on the concatenated global batch
from identical initial weights. Routed cells must show 0 parameters differing and a tiny reference error;
unrouted cells show what the bug does.
"""

from __future__ import annotations

import contextlib
import math
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .._state import forget_isolated, routing_state
from .._torch_internals import reset_dynamo
from ..adapters._copies import group_ranks
from ..crossrank import Row, compare
from ..route import Mode, route_loss
from .losses import LOSSES, make_batch
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

    def label(self) -> str:
        how = f"routed[{self.mode}]" if self.routed else "unrouted"
        opts = ",".join(f"{k}={v}" for k, v in sorted(self.wrapper_opts.items()))
        return f"{self.wrapper}{'(' + opts + ')' if opts else ''} / {self.loss} / {how}"


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
    error: str | None = None
    seconds: float = 0.0


def is_exact(cell: CellResult) -> bool:
    """No error, no gradient differing across ranks, within the reference tolerance."""
    return cell.error is None and cell.differ == 0 and cell.max_ref_diff <= REFERENCE_TOLERANCE


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

    wrapped = WRAPPERS[cell.wrapper].build(build_model(config), dict(cell.wrapper_opts))
    extras = case.extras(config)
    reference = build_none(wrapped.twin if wrapped.twin is not None else build_model(config), {})
    # under tensor parallelism the ranks of one group read one batch: batches go by data-parallel replica
    data_rank = rank if wrapped.data_rank is None else wrapped.data_rank
    data_world = world if wrapped.data_world is None else wrapped.data_world
    reference_extras = case.extras(config)
    isolated_before = routing_state().isolated
    for step in range(cell.steps):
        try:
            for micro in range(cell.accum):
                batch = make_batch(case, config, data_rank, step, micro, cell.rows)
                last = micro == cell.accum - 1
                with contextlib.nullcontext() if last else wrapped.no_sync():
                    if cell.routed:
                        loss = route_loss(
                            wrapped.model, wrapped.inner, case.compute, wrapped.inner, batch, extras, mode=cell.mode
                        )
                    else:
                        loss = case.compute(wrapped.inner, batch, extras)  # type: ignore[arg-type]
                    wrapped.backward(loss)
                result.losses.append(float(loss.detach()))
        except Exception:
            result.error = traceback.format_exc(limit=-8)
            break
        grads = wrapped.full_grads()
        differ, rank_diff = differing_across_ranks(grads)

        for micro in range(cell.accum):
            batches = [make_batch(case, config, r, step, micro, cell.rows) for r in range(data_world)]
            ref_loss = case.compute(reference.model, case.concat(batches), reference_extras)  # type: ignore[arg-type]
            (ref_loss * wrapped.loss_scale).backward()
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
