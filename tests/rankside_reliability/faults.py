"""Rank bodies for tests/test_reliability.py: faults in fn on every rank, Ctrl-C anywhere, one rank failing."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from rankside_reliability import CONFIG, build, snapshot, truth_step
from wrapperroute import route_loss
from wrapperroute.check.cell import differing_across_ranks
from wrapperroute.check.losses import LOSSES, make_batch
from wrapperroute.check.models import build_model


def fault_then_exact(wrapper: str, opts: dict[str, Any], interrupt: bool = False) -> dict[str, Any]:
    """fn raises on every rank after reading parameters (a ValueError, or KeyboardInterrupt): the wrapper is
    back in its between-steps state, and the same model's next two steps are exact."""
    wrapped, reference = build(wrapper, opts)
    inner: Any = wrapped.inner
    before = snapshot(wrapped)
    ids = make_batch(LOSSES["fused_ce"], CONFIG, dist.get_rank(), 0, 0)["input_ids"]

    def failing() -> torch.Tensor:
        hidden = inner(ids)
        _ = hidden @ inner.lm_head.weight.t()
        if interrupt:
            raise KeyboardInterrupt("boom inside the loss")
        raise ValueError("boom inside the loss")

    raised = None
    try:
        route_loss(wrapped.model, wrapped.inner, failing)
    except (ValueError, KeyboardInterrupt) as error:
        raised = f"{type(error).__name__}: {error}"
    after = snapshot(wrapped)
    steps = [truth_step(wrapped, reference, step) for step in range(2)]
    return {"raised": raised, "before": before, "after": after, "steps": steps, "end": snapshot(wrapped)}


def interrupt_anywhere(wrapper: str, opts: dict[str, Any]) -> dict[str, Any]:
    """KeyboardInterrupt at every point of a routed fused-CE call where CPython could raise one, every rank at
    the same point (tests/interrupt_points.py), the call under no_grad (an evaluation step: a training forward
    interrupted after it returned is an abandoned forward, whose aftermath is the wrapper's own). After each:
    the wrapper's between-steps state, and the next training step is exact."""
    from interrupt_points import count_points, interrupt_at

    wrapped, reference = build(wrapper, opts)
    case = LOSSES["fused_ce"]
    batch = make_batch(case, CONFIG, dist.get_rank(), 0, 0)
    steps = [truth_step(wrapped, reference, 0)]  # plans the model: later calls take the step's own path

    def call() -> Any:
        with torch.no_grad():
            return route_loss(wrapped.model, wrapped.inner, case.compute, wrapped.inner, batch, {})

    points = count_points(call)
    before = snapshot(wrapped)
    # ZeRO-3 after a whole no_grad call keeps gathered what its fetch trace will use again, as its native eval
    # forward does; after an interrupted one, recover() releases everything. Both are between-steps states: the
    # exact step after each interrupt judges.
    loose = {"sharded"} if wrapper == "zero3" else set()
    broken = []
    for point in range(1, points + 1):
        interrupted, where = interrupt_at(point, call)
        after = snapshot(wrapped)
        changed = {key: value for key, value in after.items() if before.get(key) != value and key not in loose}
        if not interrupted or changed:
            broken.append({"point": point, "where": where, "interrupted": interrupted, "changed": changed})
            break
        steps.append(truth_step(wrapped, reference, point))
    return {"points": points, "broken": broken, "before": before, "steps": steps}


# --- one rank fails -----------------------------------------------------------------------------------------


def _fail_on(rank: int, inner: Any, ids: torch.Tensor) -> torch.Tensor:
    # Fails after every parameter read, like a NaN check on the loss: under ZeRO-3 each read is a gather, and
    # a rank failing before a read would leave the others in that gather (bounded by the group's timeout).
    loss = (inner(ids) @ inner.lm_head.weight.t()).float().logsumexp(-1).mean()
    if dist.get_rank() == rank:
        raise ValueError(f"only rank {rank} fails")
    return loss


def one_rank_fails_agreed(wrapper: str, opts: dict[str, Any]) -> dict[str, Any]:
    """route_loss(..., agree=True) with fn raising on rank 1 only: every rank raises RouteStateError naming
    rank 1 (the failed one chained to its own error), the wrapper is clean, and the next steps are exact."""
    from wrapperroute import RouteStateError

    wrapped, reference = build(wrapper, opts)
    ids = make_batch(LOSSES["fused_ce"], CONFIG, dist.get_rank(), 0, 0)["input_ids"]
    before = snapshot(wrapped)
    outcome: dict[str, Any] = {}
    try:
        route_loss(wrapped.model, wrapped.inner, _fail_on, 1, wrapped.inner, ids, agree=True)
        outcome["raised"] = None
    except RouteStateError as error:
        outcome.update(raised="RouteStateError", message=str(error), cause=type(error.__cause__).__name__)
    outcome["clean"] = snapshot(wrapped) == before
    # agree=True on a step where every rank succeeds: no error, and exact
    case = LOSSES["fused_ce"]
    batch = make_batch(case, CONFIG, dist.get_rank(), 0, 0)
    loss = route_loss(wrapped.model, wrapped.inner, case.compute, wrapped.inner, batch, {}, agree=True)
    wrapped.backward(loss)
    outcome["agreed_ok"] = differing_across_ranks(wrapped.full_grads())[0] == 0
    wrapped.step()
    reference_loss = case.compute(reference.model, case.concat(
        [make_batch(case, CONFIG, r, 0, 0) for r in range(dist.get_world_size())]), {})  # type: ignore[arg-type]
    (reference_loss * wrapped.loss_scale).backward()
    reference.step()
    outcome["next"] = truth_step(wrapped, reference, 1)
    return outcome


def one_rank_fails_bounded(seconds: float) -> dict[str, Any]:
    """Without agree: DDP on a process group with a short timeout, fn raising on rank 1 only. Rank 1 gets its
    own error; rank 0 waits in the backward's all-reduce until the group's timeout, then raises. Nothing hangs
    forever: the bound is the process group's timeout."""
    import time
    from datetime import timedelta

    from torch.nn.parallel import DistributedDataParallel as DDP

    group = dist.new_group(timeout=timedelta(seconds=seconds))
    model = build_model(CONFIG)
    ddp = DDP(model, process_group=group)
    ids = make_batch(LOSSES["fused_ce"], CONFIG, dist.get_rank(), 0, 0)["input_ids"]
    start = time.perf_counter()
    outcome: dict[str, Any] = {}
    try:
        route_loss(ddp, model, _fail_on, 1, model, ids).backward()
        outcome["error"] = None
    except Exception as error:
        outcome["error"] = f"{type(error).__name__}: {str(error)[:300]}"
    outcome["seconds"] = time.perf_counter() - start
    outcome["forward_left"] = "forward" in model.__dict__
    del ddp
    dist.barrier()  # on the default group: the pool's own group is unharmed
    with contextlib.suppress(Exception):
        dist.destroy_process_group(group)
    return outcome

