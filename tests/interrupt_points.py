"""Interrupt a call at every point where CPython would raise a pending KeyboardInterrupt (tests' helper).

CPython raises a pending signal's exception only where it checks for signals: on entering a Python function
and after a call returns (or a loop jumps back). ``count_points`` finds every such point a call passes through
in wrapperroute's own code (and contextlib's, which enters and leaves our generator context managers);
``interrupt_at`` raises KeyboardInterrupt at one of them, from a trace function, which raises at exactly that
instruction. Deterministic: ranks running the same call see the same points, so each rank can be interrupted
at the same one.
"""

from __future__ import annotations

import contextlib
import dis
import gc
import inspect
import pathlib
import sys
import types
from collections.abc import Callable
from typing import Any

import wrapperroute as wr

PACKAGE = str(pathlib.Path(wr.__file__).parent)
# contextlib too: entering and leaving our generator context managers runs through its frames.
TRACED = (PACKAGE, contextlib.__file__)
# Instructions after which CPython checks for signals (3.10-3.13 names); a function's entry is the other point.
# Not 3.12's CALL_INTRINSIC_*: they call no Python code and check nothing (one runs when a generator is closed).
SIGNAL_CHECKED_AFTER = frozenset(
    name
    for name in dis.opmap
    if (name.startswith("CALL") and not name.startswith("CALL_INTRINSIC")) or name in ("JUMP_BACKWARD", "JUMP_ABSOLUTE")
)

# A generator's "call" event also fires when it is closed (no signal check there, and an exception raised
# then is only printed): its resumptions are left out, the points after calls inside it are kept.
RESUMABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def trace_opcodes(frame: types.FrameType, trace: Callable[..., Any]) -> None:
    """Ask for ``frame``'s opcode events, from inside the trace function.

    CPython 3.12 (measured on 3.12.1) ignores ``f_trace_opcodes`` set during a trace event until tracing is
    set again: without the second ``settrace`` no opcode event fires at all.
    """
    was = frame.f_trace_opcodes
    frame.f_trace_opcodes = True
    if not was and sys.version_info[:2] == (3, 12):
        sys.settrace(trace)


def points_tracer(on_point: Callable[[types.FrameType], None]) -> Callable[..., Any]:
    """A trace function calling ``on_point(frame)`` at every signal-check point inside wrapperroute's code."""
    previous: dict[int, str] = {}

    def trace(frame: types.FrameType, event: str, arg: Any) -> Any:
        if not frame.f_code.co_filename.startswith(TRACED):
            return None  # not ours: neither traced nor interrupted (the loss and torch run untouched)
        trace_opcodes(frame, trace)
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


@contextlib.contextmanager
def no_collection(first: bool = False) -> Any:
    """No garbage collection while a step is traced (``first``: after one now): a finalizer of ours (a plan
    dropped with its model) run by a collection in the middle of the step would add points, and swallow an
    interrupt raised there."""
    if first:
        gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def interrupt_at(point: int, step: Callable[[], Any]) -> tuple[bool, str]:
    """Run ``step`` with KeyboardInterrupt raised at signal-check point number ``point`` (1-based)."""
    seen = [0]
    where = ["(no point reached)"]

    def on_point(frame: types.FrameType) -> None:
        seen[0] += 1
        if seen[0] == point:
            where[0] = f"{frame.f_code.co_name}:{frame.f_lineno}"
            raise KeyboardInterrupt(f"injected at {where[0]}")

    with no_collection():
        sys.settrace(points_tracer(on_point))
        try:
            step()
        except KeyboardInterrupt:
            return True, where[0]
        finally:
            sys.settrace(None)
    return False, where[0]


def count_points(step: Callable[[], Any]) -> int:
    seen = [0]

    def on_point(frame: types.FrameType) -> None:
        seen[0] += 1

    with no_collection(first=True):
        sys.settrace(points_tracer(on_point))
        try:
            step()
        finally:
            sys.settrace(None)
    return seen[0]
