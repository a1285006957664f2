"""The token and the forward swap: how a loss runs inside a wrapper's forward.

The wrapper's forward calls one inner module (``ddp.module``, ``fsdp._fsdp_wrapped_module``, the FSDP2 root
itself, ``engine.module``). For the length of one call that module gets an instance ``forward`` (the
*dispatch*) that runs the loss, and the wrapper is called with a single opaque *token* carrying the loss and
its arguments. The swap is shared by every in-flight call on one module and reference-counted; the last call
out restores the original forwards.

Why a token and not the loss's arguments: wrappers move, cast and scatter their inputs (DDP's ``_to_kwargs``,
FSDP2's mixed-precision cast), and with DDP ``device_ids`` set a call with no argument at all fails. The payload
travels in the token, untouched, and each call carries its own, so two threads routing through one model never
see each other's loss.
"""

from __future__ import annotations

import contextlib
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from ._kept import kept_forward_context
from .adapters import Adapter
from .adapters.base import NOTHING
from .errors import RouteStateError, RouteTypeError


class _Inside(NamedTuple):
    """What the adapter enters around the loss, inside the forward (``Adapter.inside``), and the nested shard
    units whose forwards the loss runs through (outermost first)."""

    adapter: Adapter
    isolate: bool
    gather: tuple[nn.Module, ...]
    nested: tuple[nn.Module, ...]


_MISSING = object()


def _original_forward(module: nn.Module, saved: object) -> Callable[..., Any]:
    """What ``module.forward`` was before we swapped it: the instance forward we saved, else the class's."""
    return saved if saved is not _MISSING else type(module).forward.__get__(module)  # type: ignore[return-value]


# Results whose body has not run yet: a loss computed from them would run outside the wrapper's forward.
_LAZY_RESULTS = frozenset({types.CoroutineType, types.GeneratorType, types.AsyncGeneratorType})


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.routing: set[int] = set()  # ids of wrappers whose forward is running a loss in this thread


_thread = _ThreadState()


class _Token:
    """The token handed to the wrapper: the loss and everything needed to run it inside the forward."""

    __slots__ = ("args", "extra", "fn", "kwargs", "ran", "result_check", "wrapper")

    def __init__(
        self,
        wrapper: nn.Module,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        extra: _Inside | None,
        check: Callable[[nn.Module, Any], None] | None,
    ) -> None:
        self.wrapper = wrapper
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.extra = extra  # (adapter, isolate, gather, nested units) for adapter.inside; None: nothing to enter
        self.result_check = check  # the adapter's result check, if it has one
        self.ran = False  # set when the wrapper's forward reached the loss: else the wrapper changed the token

    def __repr__(self) -> str:  # shows up in wrapper error messages; keep it short
        return f"<wrapperroute call of {getattr(self.fn, '__qualname__', type(self.fn).__name__)}>"


def _run_inside(call: _Token, kept: Callable[[], contextlib.AbstractContextManager[Any]] | None) -> Any:
    """The loss inside what must be entered around it: the contexts of the target's own instance forward
    (accelerate's autocast), and the adapter's (a gather, the functorch isolation, nested shard units)."""
    with kept() if kept is not None else NOTHING:
        if call.extra is None:
            return call.fn(*call.args, **call.kwargs)
        adapter, isolate, gather, nested = call.extra
        with adapter.inside(call.wrapper, isolate=isolate, gather=gather):
            if nested:  # a shard unit the loss reads from: enter its forward too
                unit = nested[0]
                rest = call.extra._replace(nested=nested[1:])
                token = _Token(unit, call.fn, call.args, call.kwargs, rest, call.result_check)
                return _enter_wrapper(unit, adapter, None, None, token, unit)
            return call.fn(*call.args, **call.kwargs)


def _validate_result(call: _Token, result: Any) -> None:
    if type(result) in _LAZY_RESULTS:
        raise RouteTypeError(
            f"fn returned a {type(result).__name__}: its body has not run, so the loss would be "
            "computed later, outside the wrapper's forward. Pass a plain function that returns the "
            "loss (call the async/generator function yourself inside it)."
        )
    if call.result_check is not None:
        call.result_check(call.wrapper, result)


class _Swap:
    """The swapped forwards of one target module and of the wrapper calling it, shared by every in-flight
    call on the target (refcounted under ``lock``: the first call in swaps the target's forward for
    ``dispatch``, the last call out restores both).

    The wrapper's ``passthrough``: while a loss runs, a call of the wrapper itself from the loss (fn calling
    model(...)) must be a plain call of the inner module: the wrapper is already prepared, and its
    pre/post-forward again would re-arm DDP's reducer or reshard FSDP parameters mid-loss. It decides per
    thread, so another thread's model(...) stays a real forward. (FSDP2's wrapper is the target: its adapter
    sets hooks aside instead.)

    Built once per target and kept while the target lives; it holds the target only weakly, and the wrapper
    only while calls are in flight.
    """

    __slots__ = (
        "count", "dispatch", "grad_calls", "kept", "kept_source", "last_wrapper", "lock", "passthrough", "saved",
        "saved_wrapper", "target_id", "wrapper",
    )  # fmt: skip

    def __init__(self, target: nn.Module) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.grad_calls = 0  # in-flight calls recording a graph
        self.saved: object = _MISSING  # the target's instance forward we replaced, while swapped
        self.kept: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
        self.kept_source: weakref.ref[Any] | None = None  # the instance forward ``kept`` was read from
        self.wrapper: nn.Module | None = None  # while the passthrough is in
        self.saved_wrapper: object = _MISSING  # the wrapper's instance forward it replaced
        self.last_wrapper: weakref.ref[nn.Module] | None = None  # the wrapper it was last put on (weakly)
        self.target_id = id(target)  # a wrapper that is its own target (FSDP2) gets no passthrough
        target_ref = weakref.ref(target)
        self.dispatch = _make_dispatch(target_ref, self)
        self.passthrough = _make_passthrough(target_ref, self)

    def keep(self, target: nn.Module, saved: Any) -> None:
        """The target had an instance forward (accelerate's AMP wrapper): read the contexts to keep, once per
        distinct forward."""
        if self.kept_source is not None and self.kept_source() is saved:
            return
        self.kept = kept_forward_context(target, saved)
        try:
            self.kept_source = weakref.ref(saved)
        except TypeError:  # not weakly referenceable: read it again next time
            self.kept_source = None


_swaps: dict[int, _Swap] = {}


_swaps_lock = threading.Lock()


def _swap_for(target: nn.Module) -> _Swap:
    state = _swaps.get(id(target))
    if state is None:
        with _swaps_lock:
            state = _swaps.get(id(target))
            if state is None:
                state = _swaps[id(target)] = _Swap(target)
                weakref.finalize(target, _swaps.pop, id(target), None)
    return state


def _make_dispatch(target_ref: weakref.ref[nn.Module], state: _Swap) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        call = args[0] if args else None
        if type(call) is not _Token or len(args) != 1 or kwargs:
            # Another thread calling the model normally while a loss is routed: behave as the real forward. (A
            # wrapper that changed our token lands here too; _enter_wrapper then says so.)
            target = target_ref()
            if target is None:  # unreachable while the module is being called; keeps the types honest
                raise RouteStateError("the routed module was garbage-collected during its own forward")
            return _original_forward(target, state.saved)(*args, **kwargs)
        call.ran = True
        wrapper = call.wrapper
        if state.wrapper is None and id(wrapper) != state.target_id:
            # The wrapper's passthrough goes in from inside its forward, so our own call of the wrapper never
            # runs through it; the last call out restores it. One per target: a second wrapper over the same
            # module (rare) keeps its own forward, as a second thread's call finds the passthrough in.
            with state.lock:
                if state.wrapper is None:
                    state.last_wrapper = weakref.ref(wrapper)
                    state.wrapper, state.saved_wrapper = wrapper, wrapper.__dict__.get("forward", _MISSING)
                    wrapper.__dict__["forward"] = state.passthrough
        routing = _thread.routing
        key = id(wrapper)
        try:
            routing.add(key)  # a call of the wrapper from the loss is now a plain inner call (passthrough)
            kept = state.kept
            if kept is None and call.extra is None:  # DDP's every step: nothing to enter around the loss
                result = call.fn(*call.args, **call.kwargs)
            else:
                result = _run_inside(call, kept)
        finally:
            routing.discard(key)
        if call.result_check is not None or type(result) in _LAZY_RESULTS:
            _validate_result(call, result)
        return result

    return forward


def _make_passthrough(target_ref: weakref.ref[nn.Module], state: _Swap) -> Callable[..., Any]:
    """The wrapper's ``forward`` while losses run inside it: in a thread running one, calling the wrapper is a
    plain call of the inner module; in any other thread, the wrapper's real forward."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        wrapper = state.wrapper
        if wrapper is None:
            # Read while it was in (another thread's plain model(...) looked it up, then the last routed call
            # ended): the wrapper's forward is back, so run that. Only a copy kept somewhere else is stale.
            wrapper = state.last_wrapper() if state.last_wrapper is not None else None
            if wrapper is None or wrapper.__dict__.get("forward") is forward:
                raise RouteStateError("the routed wrapper was called after its loss ended, through a stale forward")
            return wrapper.forward(*args, **kwargs)
        if id(wrapper) in _thread.routing:
            target = target_ref()
            if target is None:  # unreachable while a loss runs inside the wrapper
                raise RouteStateError("the routed module was garbage-collected during its own forward")
            return target(*args, **kwargs)
        return _original_forward(wrapper, state.saved_wrapper)(*args, **kwargs)

    return forward


class _RefusedError(RouteStateError):
    """Another thread is inside this wrapper's forward: refused before entering anything."""


def _enter_wrapper(
    wrapper: nn.Module,
    adapter: Adapter,
    target: nn.Module | None,
    state: _Swap | None,
    call: _Token,
    callee: nn.Module | None,
) -> Any:
    """Call ``callee`` (the wrapper, or a layer entered around it; None: gone with its model, the wrapper) with
    ``call``, the token whose loss runs in ``target``'s swapped forward (``target``/``state`` None: a nested
    shard unit, looked up here)."""
    if target is None or state is None:  # a nested shard unit: looked up per call (FSDP1, not the hot path)
        target = adapter.redirect_target(wrapper)
        state = _swap_for(target)
    grad = torch.is_grad_enabled()
    entered = False
    # Ctrl-C (KeyboardInterrupt) can land wherever Python checks for signals: after any call returns, and on
    # entering a Python function. The bookkeeping below is ordered so that no such point lies between a change
    # of state and the cleanup that undoes it (``with``, not acquire(); ``entered`` set with no call since the
    # swap; the restore inline, stores and deletes only). tests/test_route_interrupts.py interrupts every such point.
    try:
        with state.lock:
            if state.count:  # another thread is inside this wrapper's forward (one thread never gets here twice)
                reason = adapter.concurrency_error(wrapper, grad, state.grad_calls)
                if reason is not None:
                    raise _RefusedError(
                        f"another thread is running a routed forward through this {adapter.kind} wrapper right "
                        f"now, and {reason}. Serialise the steps (one lock around route_loss and backward), route "
                        "evaluation calls under torch.no_grad() (DDP), or use separate models on separate process "
                        "groups."
                    )
            else:  # the first call in: swap the target's forward for the dispatch
                saved = state.saved = target.__dict__.get("forward", _MISSING)
                if saved is not _MISSING:
                    state.keep(target, saved)
                elif state.kept is not None:
                    state.kept = state.kept_source = None
                target.__dict__["forward"] = state.dispatch
            state.count += 1
            state.grad_calls += grad
            entered = True
        result = (wrapper if callee is None else callee)(call)
    except BaseException as error:
        if entered and not call.ran:  # the wrapper's own error, or a mangled token
            _add_note(
                error,
                f"wrapperroute: raised by the {adapter.kind} wrapper before the loss ran (in its pre-forward, or "
                f"because it did not pass wrapperroute's call token to {type(target).__name__}.forward unchanged)",
            )
        raise
    finally:
        if entered:
            with state.lock:
                state.count -= 1
                state.grad_calls -= grad
                if not state.count:  # the last call out puts the original forwards back (written out: no call)
                    forwards = target.__dict__
                    if state.saved is not _MISSING:
                        forwards["forward"] = state.saved
                    elif "forward" in forwards:
                        del forwards["forward"]
                    state.saved = _MISSING
                    passed = state.wrapper
                    if passed is not None:
                        forwards = passed.__dict__
                        if state.saved_wrapper is not _MISSING:
                            forwards["forward"] = state.saved_wrapper
                        elif "forward" in forwards:
                            del forwards["forward"]
                        state.wrapper, state.saved_wrapper = None, _MISSING
    if not call.ran:
        raise _token_lost(target)
    return result


def _add_note(error: BaseException, note: str) -> None:
    """PEP 678's note; on Python 3.10 (no ``add_note``) the same ``__notes__`` list, which pytest and the
    ``exceptiongroup`` backport print."""
    add_note = getattr(error, "add_note", None)
    if add_note is not None:
        add_note(note)
        return
    with contextlib.suppress(Exception):  # an exception type that refuses attributes keeps its own message
        error.__notes__ = [*getattr(error, "__notes__", ()), note]  # type: ignore[attr-defined]


def _token_lost(target: nn.Module) -> RouteStateError:
    return RouteStateError(
        f"the wrapper returned without running the loss: it did not pass wrapperroute's call token to "
        f"{type(target).__name__}.forward unchanged. Report this wrapper; meanwhile compute the loss through "
        "model(...) directly."
    )
