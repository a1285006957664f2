"""Rank bodies for tests/test_reliability.py: faults in fn on every rank, Ctrl-C anywhere, one rank failing."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist

from rankside_reliability import CONFIG, build, changed, snapshot, truth_step
from wrapperroute import route_loss
from wrapperroute.check.cell import differing_across_ranks
from wrapperroute.check.losses import LOSSES, make_batch
from wrapperroute.check.models import build_model


def fault_then_exact(wrapper: str, opts: dict[str, Any], interrupt: bool = False) -> None:
    """fn raises on every rank after reading parameters (a ValueError, or KeyboardInterrupt): the wrapper is
    back in its between-steps state, and the same model's next two steps are exact (and, after a ValueError,
    leave it in that state again)."""
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
    if interrupt:
        assert raised is not None and raised.startswith("KeyboardInterrupt"), f"fn's KeyboardInterrupt became {raised}"
    else:
        assert raised == "ValueError: boom inside the loss", f"fn's ValueError became {raised}"
    after = snapshot(wrapped)
    left = changed(before, after)
    assert not left, f"the failed call changed the wrapper's state (before, after): {left}"
    if not interrupt:
        assert after["sharded"] and not after["in_forward"], f"not between steps after the failed call: {after}"
    for step in range(2):
        truth_step(wrapped, reference, step, after=f"fn raised {raised}")
    if not interrupt:
        left = changed(before, snapshot(wrapped))
        assert not left, f"two routed steps left the wrapper's state changed (before, after): {left}"


def interrupt_anywhere(wrapper: str, opts: dict[str, Any]) -> None:
    """KeyboardInterrupt at every point of a routed fused-CE call where CPython could raise one, every rank at
    the same point (tests/interrupt_points.py), the call under no_grad (an evaluation step: a training forward
    interrupted after it returned is an abandoned forward, whose aftermath is the wrapper's own). After each:
    the wrapper's between-steps state, and the next training step is exact."""
    from interrupt_points import count_points, interrupt_at

    wrapped, reference = build(wrapper, opts)
    case = LOSSES["fused_ce"]
    batch = make_batch(case, CONFIG, dist.get_rank(), 0, 0)
    truth_step(wrapped, reference, 0)  # plans the model: later calls take the step's own path

    def call() -> Any:
        with torch.no_grad():
            return route_loss(wrapped.model, wrapped.inner, case.compute, wrapped.inner, batch, {})

    points = count_points(call)
    assert points > 30, f"only {points} points where a KeyboardInterrupt could be raised: the count is broken"
    before = snapshot(wrapped)
    # ZeRO-3 after a whole no_grad call keeps gathered what its fetch trace will use again, as its native eval
    # forward does; after an interrupted one, recover() releases everything. Both are between-steps states: the
    # exact step after each interrupt judges.
    loose = {"sharded"} if wrapper == "zero3" else set()
    for point in range(1, points + 1):
        interrupted, where = interrupt_at(point, call)
        left = {key: values for key, values in changed(before, snapshot(wrapped)).items() if key not in loose}
        assert interrupted, f"point {point} of {points} ({where}): the KeyboardInterrupt never reached the caller"
        assert not left, f"point {point} of {points} ({where}): the interrupted call changed the wrapper: {left}"
        truth_step(wrapped, reference, point, after=f"Ctrl-C at point {point} of {points} ({where})")


# --- one rank fails -----------------------------------------------------------------------------------------


def _fail_on(rank: int, inner: Any, ids: torch.Tensor) -> torch.Tensor:
    # Fails after every parameter read, like a NaN check on the loss: under ZeRO-3 each read is a gather, and
    # a rank failing before a read would leave the others in that gather (bounded by the group's timeout).
    loss = (inner(ids) @ inner.lm_head.weight.t()).float().logsumexp(-1).mean()
    if dist.get_rank() == rank:
        raise ValueError(f"only rank {rank} fails")
    return loss


def one_rank_fails_agreed(wrapper: str, opts: dict[str, Any]) -> None:
    """route_loss(..., agree=True) with fn raising on rank 1 only: every rank raises RouteStateError naming
    rank 1 (the failed one chained to its own error), the wrapper is clean, and the next steps are exact."""
    from wrapperroute import RouteStateError

    rank = dist.get_rank()
    wrapped, reference = build(wrapper, opts)
    ids = make_batch(LOSSES["fused_ce"], CONFIG, rank, 0, 0)["input_ids"]
    before = snapshot(wrapped)
    raised: Exception | None = None
    try:
        route_loss(wrapped.model, wrapped.inner, _fail_on, 1, wrapped.inner, ids, agree=True)
    except RouteStateError as error:
        raised = error
    assert type(raised).__name__ == "RouteStateError", f"agree=True with rank 1's fn raising: {raised!r}"
    assert "failed on rank(s) [1]" in str(raised), f"the error does not name rank 1: {raised}"
    cause = type(raised.__cause__).__name__
    assert cause == ("ValueError" if rank == 1 else "NoneType"), f"rank {rank}'s RouteStateError is chained to {cause}"
    left = changed(before, snapshot(wrapped))
    assert not left, f"the agreed failure changed the wrapper's state: {left}"
    # agree=True on a step where every rank succeeds: no error, and exact
    case = LOSSES["fused_ce"]
    batch = make_batch(case, CONFIG, rank, 0, 0)
    loss = route_loss(wrapped.model, wrapped.inner, case.compute, wrapped.inner, batch, {}, agree=True)
    wrapped.backward(loss)
    differ = differing_across_ranks(wrapped.full_grads())[0]
    assert differ == 0, f"an agreed step where every rank succeeds: {differ} parameters' gradients differ across ranks"
    wrapped.step()
    reference_loss = case.compute(
        reference.model, case.concat([make_batch(case, CONFIG, r, 0, 0) for r in range(dist.get_world_size())]), {}
    )  # type: ignore[arg-type]
    (reference_loss * wrapped.loss_scale).backward()
    reference.step()
    truth_step(wrapped, reference, 1, after="an agreed failure and an agreed step")


def one_rank_fails_bounded(seconds: float, within: tuple[float, float]) -> None:
    """Without agree: DDP on a process group with a ``seconds`` timeout, fn raising on rank 1 only. Rank 1 gets
    its own error; rank 0 waits in the backward's all-reduce until the group's timeout, then raises, after a
    time ``within`` these bounds. Nothing hangs forever: the bound is the process group's timeout."""
    import time
    from datetime import timedelta

    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    group = dist.new_group(timeout=timedelta(seconds=seconds))
    model = build_model(CONFIG)
    ddp = DDP(model, process_group=group)
    ids = make_batch(LOSSES["fused_ce"], CONFIG, rank, 0, 0)["input_ids"]
    start = time.perf_counter()
    error = None
    try:
        route_loss(ddp, model, _fail_on, 1, model, ids).backward()
    except Exception as raised:
        error = f"{type(raised).__name__}: {str(raised)[:300]}"
    waited = time.perf_counter() - start
    forward_left = "forward" in model.__dict__
    del ddp
    dist.barrier()  # on the default group: the pool's own group is unharmed (and both ranks reach the asserts)
    with contextlib.suppress(Exception):
        dist.destroy_process_group(group)
    if rank == 1:
        assert error == "ValueError: only rank 1 fails", f"the failing rank raised {error}"
    else:
        assert error is not None and "Timed out" in error, f"the waiting rank raised {error}, not the group's timeout"
        assert within[0] <= waited <= within[1], f"the waiting rank raised after {waited:.1f}s, not within {within}"
    assert not forward_left, "the forward was left swapped"
