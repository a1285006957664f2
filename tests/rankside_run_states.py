"""Rank bodies for tests/test_run_states.py: routing and its reports after what a real run goes through (a plain
forward that raised, NaN on one rank, a process group destroyed and made again). Module level: the pool pickles
them by reference."""

from __future__ import annotations

import math
import sys
from typing import Any

import rankside_reliability as rr
import torch
import torch.distributed as dist

from wrapperroute import check_grad_sync, detect, route_loss
from wrapperroute.check.cell import REFERENCE_TOLERANCE, differing_across_ranks, max_grad_diff
from wrapperroute.check.losses import LOSSES, make_batch


def raised_forward_then_exact(wrapper: str, opts: dict[str, Any], step_after: bool) -> None:
    """A routed step's backward, then a plain ``model(batch)`` raising inside the wrapper's forward (a token id
    out of range: the batch a loop skips), the optimizer's step after it (``step_after``: so the parameters that
    failed forward gathered are stale) or before it, then two routed steps, each against one process on the
    global batch."""
    wrapped, reference = rr.build(wrapper, opts)
    found = detect(wrapped.model)
    case = LOSSES["fused_ce"]
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = make_batch(case, rr.CONFIG, rank, 0, 0)
    loss = route_loss(wrapped.model, wrapped.inner, case.compute, wrapped.inner, batch, {})
    wrapped.backward(loss)
    if not step_after:
        wrapped.step()
    bad = torch.full((2, rr.CONFIG.seq), rr.CONFIG.vocab + 7)
    raised = None
    try:
        wrapped.model(bad)
    except Exception as error:
        raised = type(error).__name__
    assert raised is not None, "a forward on token ids out of range did not raise"
    # what fooled a check of "inside the forward" that read the wrapper's own state
    stale = found.adapter.marks_forward(found.wrapper)  # type: ignore[union-attr,arg-type]
    # the premise (DDP restores its marker itself)
    assert stale == (wrapper != "ddp"), f"after the forward raised {raised}, the wrapper's in-forward mark is {stale}"
    if step_after:
        wrapped.step()
    batches = [make_batch(case, rr.CONFIG, r, 0, 0) for r in range(world)]
    (case.compute(reference.model, case.concat(batches), {}) * wrapped.loss_scale).backward()  # type: ignore[arg-type]
    reference.step()
    for step in (1, 2):
        rr.truth_step(wrapped, reference, step, after=f"a plain forward that raised {raised}")


def nan_and_dtype_reports() -> None:
    """check_grad_sync on DDP gradients set by hand compares values as they are: NaN on rank 1 only differs
    (and is named non-finite); NaN alike on both ranks does not differ (but is named); a float64 difference
    below float32's resolution on rank 1 differs, by its own size; equal gradients report nothing."""
    from torch.nn.parallel import DistributedDataParallel

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).double())
    for case in ("nan_on_rank1", "nan_alike", "float64_tiny", "equal"):
        for param in model.parameters():
            param.grad = torch.ones_like(param)
        first = model.module[0].weight.grad
        if case == "nan_on_rank1" and rank == 1:
            first[0, 0] = math.nan
        if case == "nan_alike":
            first[1, 1] = math.nan
        if case == "float64_tiny" and rank == 1:
            first[2, 2] += 1e-12  # 1 + 1e-12 is 1 in float32
        report = check_grad_sync(model)
        found = {"differing": report.differing, "nonfinite": list(report.nonfinite),
                 "worst": [name for name, _ in report.worst], "max": report.max_abs_diff}  # fmt: skip
        if case == "nan_on_rank1":
            assert found["differing"] == 1 and found["worst"] == ["0.weight"], f"{case}: {found}"
            assert found["nonfinite"] == ["0.weight"], f"{case}: {found}"
        elif case == "nan_alike":
            assert found["differing"] == 0 and found["nonfinite"] == ["0.weight"], f"{case}: {found}"
        elif case == "float64_tiny":
            assert found["differing"] == 1 and abs(found["max"] - 1e-12) <= 1e-14, f"{case}: {found}"
            # the premise: float32 cannot see this difference
            assert torch.equal(first.float(), torch.ones_like(first).float()), "float32 sees the 1e-12 difference"
        else:
            assert found == {"differing": 0, "nonfinite": [], "worst": [], "max": 0.0}, f"{case}: {found}"


def agree_after_new_process_group(store: str) -> None:
    """``route_loss(..., agree=True)`` exact, then the default group destroyed and made again (a notebook
    re-running its set-up cell), then routed with ``agree=True`` again on a new DDP: exact. The premise: the
    side group made under the first default group is unknown to the second."""
    from wrapperroute._groups import side_group

    rank, world = dist.get_rank(), dist.get_world_size()
    _agreed_step("before the group is made again")
    old = side_group(tuple(range(world)))
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    dead = None
    try:
        dist.get_backend(old)  # what the flag exchange asked of the side group it kept
    except Exception as error:
        dead = f"{type(error).__name__}: {error}"
    assert dead is not None, "the side group kept from the first default group still answers: the premise fails"
    _agreed_step("after the group is made again")


def _agreed_step(when: str) -> None:
    """One routed step with agree=True on a new DDP: exact."""
    wrapped, reference = rr.build("ddp")
    case = LOSSES["fused_ce"]
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = make_batch(case, rr.CONFIG, rank, 0, 0)
    loss = route_loss(wrapped.model, wrapped.inner, case.compute, wrapped.inner, batch, {}, agree=True)
    wrapped.backward(loss)
    grads = wrapped.full_grads()
    batches = [make_batch(case, rr.CONFIG, r, 0, 0) for r in range(world)]
    case.compute(reference.model, case.concat(batches), {}).backward()  # type: ignore[arg-type]
    differ, ref_diff = differing_across_ranks(grads)[0], max_grad_diff(grads, reference.full_grads())
    assert grads and differ == 0, f"{when}: {differ} of {len(grads)} parameters' gradients differ across ranks"
    assert ref_diff <= REFERENCE_TOLERANCE, f"{when}: gradients {ref_diff:.3g} from one process's on the global batch"


def _summed(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).sum()


def unrouted_warning_lines() -> None:
    """Where UnroutedModelWarning points when reached through route_loss, a partial of it, and a helper of the
    user's: the first line outside wrapperroute (here, in this file), each time (a new model each time: the
    warning is said once per model)."""
    import functools
    import warnings

    def helper(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        line = sys._getframe().f_lineno + 1
        return route_loss(model, model, lambda: model(x).sum()), line

    x = torch.ones(2, 4)
    for way in ("route_loss", "partial", "helper"):
        model = torch.nn.Linear(4, 4)
        total = functools.partial(_summed, model, x)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if way == "route_loss":
                line = sys._getframe().f_lineno + 1
                route_loss(model, model, total)
            elif way == "partial":
                line = sys._getframe().f_lineno + 1
                functools.partial(route_loss, model, model, total)()
            else:
                _, line = helper(model, x)
        said = [(w.filename, w.lineno) for w in caught if type(w.message).__name__ == "UnroutedModelWarning"]
        assert said == [(__file__, line)], f"through {way}: said at {said}, not once at this file's line {line}"
