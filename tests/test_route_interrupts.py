"""Ctrl-C anywhere in a routed call leaves no state behind (a notebook user interrupts a step and trains on).

CPython raises a pending KeyboardInterrupt only where it checks for signals: on entering a Python function and
after a call returns (or a loop jumps back). These tests find every such point that a routed DDP call passes
through in wrapperroute's own code, raise KeyboardInterrupt at each one in turn (from a trace function, which
raises at exactly that instruction), and check after each: the interrupt reached the caller, no ``forward``
attribute is left on the model or the wrapper, no lock is held, and the next routed step is exact.

One process, one real gloo rank (DDP on a one-rank group): the state checked is per process.
"""

from __future__ import annotations

import dis
import inspect
import pathlib
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import wrapperroute as wr
from wrapperroute import route as route_module

PACKAGE = str(pathlib.Path(wr.__file__).parent)
# Instructions after which CPython checks for signals (3.10-3.13 names); a function's entry is the other point.
SIGNAL_CHECKED_AFTER = frozenset(
    name for name in dis.opmap if name.startswith("CALL") or name in ("JUMP_BACKWARD", "JUMP_ABSOLUTE")
)

# A generator's "call" event also fires when it is closed (no signal check there, and an exception raised
# then is only printed): its resumptions are left out, the points after calls inside it are kept.
RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def _points_tracer(on_point: Callable[[types.FrameType], None]) -> Callable[..., Any]:
    """A trace function calling ``on_point(frame)`` at every signal-check point inside wrapperroute's code."""
    previous: dict[int, str] = {}

    def trace(frame: types.FrameType, event: str, arg: Any) -> Any:
        if not frame.f_code.co_filename.startswith(PACKAGE):
            return None  # not ours: neither traced nor interrupted (the loss and torch run untouched)
        frame.f_trace_opcodes = True
        if event == "call" and not frame.f_code.co_flags & RESUMABLE:
            on_point(frame)
        elif event == "opcode":
            name = dis.opname[frame.f_code.co_code[frame.f_lasti]]
            if previous.get(id(frame)) in SIGNAL_CHECKED_AFTER:
                on_point(frame)
            previous[id(frame)] = name
        elif event == "return":
            previous.pop(id(frame), None)
        return trace

    return trace


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


_MISSING = object()
CASES = ["plain", "find_unused", "isolate", "loss_calls_wrapper", "instance_forward"]


def _build(case: str) -> tuple[nn.Module, DDP, Callable[[], torch.Tensor], dict[str, Any]]:
    """A DDP model and a routed loss exercising one path of the routed call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    if case == "instance_forward":  # what accelerate's mixed precision leaves: an instance forward to keep
        model.forward = types.MethodType(type(model).forward, model)
    ddp = DDP(model, find_unused_parameters=case == "find_unused")
    x = torch.randn(3, 4)
    if case == "loss_calls_wrapper":  # inside the loss, the wrapper is a plain call (its passthrough)
        return model, ddp, lambda: ddp(x).square().sum(), {}
    return model, ddp, lambda: model(x).square().sum(), {"mode": "isolate"} if case == "isolate" else {}


def _routed_step(ddp: DDP, model: nn.Module, loss: Callable[[], torch.Tensor], options: dict[str, Any]) -> Any:
    model.zero_grad(set_to_none=True)
    wr.route_loss(ddp, model, loss, **options).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _interrupt_at(point: int, step: Callable[[], Any]) -> tuple[bool, str]:
    """Run ``step`` with KeyboardInterrupt raised at signal-check point number ``point`` (1-based)."""
    seen = [0]
    where = ["(no point reached)"]

    def on_point(frame: types.FrameType) -> None:
        seen[0] += 1
        if seen[0] == point:
            where[0] = f"{frame.f_code.co_name}:{frame.f_lineno}"
            raise KeyboardInterrupt(f"injected at {where[0]}")

    sys.settrace(_points_tracer(on_point))
    try:
        step()
    except KeyboardInterrupt:
        return True, where[0]
    finally:
        sys.settrace(None)
    return False, where[0]


def _count_points(step: Callable[[], Any]) -> int:
    seen = [0]

    def on_point(frame: types.FrameType) -> None:
        seen[0] += 1

    sys.settrace(_points_tracer(on_point))
    try:
        step()
    finally:
        sys.settrace(None)
    return seen[0]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("grad", [True, False], ids=["train", "no_grad"])
def test_interrupt_anywhere_leaves_no_state(one_rank: None, grad: bool, case: str) -> None:
    model, ddp, loss, options = _build(case)
    before = (model.__dict__.get("forward", _MISSING), ddp.__dict__.get("forward", _MISSING))
    reference = _routed_step(ddp, model, loss, options)  # also plans the model: later calls take the step's path
    assert reference and all(g.abs().sum() > 0 for g in reference.values())

    def step() -> Any:
        with torch.set_grad_enabled(grad):
            return wr.route_loss(ddp, model, loss, **options)

    points = _count_points(step)
    assert points > 30, points  # the tracer sees the routed call's own code
    state = route_module._plans[id(ddp)].state
    assert state is not None
    leftovers = []
    for point in range(1, points + 1):
        interrupted, where = _interrupt_at(point, step)
        left = [
            what
            for what, bad in (
                ("the interrupt was swallowed", not interrupted),
                ("model.forward not put back", model.__dict__.get("forward", _MISSING) is not before[0]),
                ("ddp.forward not put back", ddp.__dict__.get("forward", _MISSING) is not before[1]),
                ("lock held", state.lock.locked()),
                ("a call still counted in flight", state.count != 0 or state.grad_calls != 0),
                ("this thread still marked as routing", bool(route_module._thread.routing)),
            )
            if bad
        ]
        if left:
            leftovers.append((point, where, left))
            break  # the state is broken: later points would only repeat it
        after = _routed_step(ddp, model, loss, options)
        if after.keys() != reference.keys() or any(not torch.equal(after[k], reference[k]) for k in reference):
            leftovers.append((point, where, ["the next routed step's gradients differ"]))
            break
    assert not leftovers, leftovers
