"""The mechanism: the routed call, the forward swap, and entering the wrapper with it.

The wrapper's forward calls one inner module (``ddp.module``, ``fsdp._fsdp_wrapped_module``, the FSDP2 root
itself, ``engine.module``): its *target*. For the length of one routed call the target gets an instance
``forward`` (the *dispatch*) that runs the loss, and the wrapper is called with a single opaque argument, the
*call* (``Call``), carrying the loss, its arguments and everything needed to run it there. The swap is shared
by every routed call in flight on one target and reference-counted; the last call out restores the original
forwards.

Why the call and not the loss's arguments: wrappers move, cast and scatter their inputs (DDP's ``_to_kwargs``,
FSDP2's mixed-precision cast), and with DDP ``device_ids`` set a call with no argument at all fails. The
arguments travel in the call, untouched, and each call carries its own, so two threads routing through one model
never see each other's loss.
"""

from __future__ import annotations

import contextlib
import threading
import types
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from ..adapters.routing import NOTHING
from ..errors import RouteStateError, RouteTypeError
from . import state
from .kept import kept_forward_context

if TYPE_CHECKING:
    from ..adapters import AroundLoss, Isolating, Routing


class Around(NamedTuple):
    """What is entered around the loss inside the forward, and the nested shard units whose forwards the loss runs
    through (outermost first).

    surrounds
        The adapter whose ``around_loss`` is entered on every call (its wrapper's hooks set aside), or None.
    isolation
        The adapter whose ``isolated`` context keeps its compiler pass away from the loss, or None: not isolated.
    """

    surrounds: AroundLoss | None
    isolation: Isolating | None
    gather: tuple[nn.Module, ...]
    nested: tuple[nn.Module, ...]


MISSING = object()  # absent from an instance's ``__dict__`` (no instance forward of its own)


def _original_forward(module: nn.Module, saved: object) -> Callable[..., Any]:
    """What ``module.forward`` was before we swapped it: the instance forward we saved, else the class's."""
    return saved if saved is not MISSING else type(module).forward.__get__(module)  # type: ignore[return-value]


# Results whose body has not run yet: a loss computed from them would run outside the wrapper's forward.
_LAZY_RESULTS = frozenset({types.CoroutineType, types.GeneratorType, types.AsyncGeneratorType})


class Call:
    """One routed call: the loss and its arguments, the wrapper it runs inside and how to get there. Handed to
    the wrapper as its only argument, it reaches the target's swapped forward untouched."""

    __slots__ = (
        "adapter", "args", "around", "entry", "fn", "kwargs", "mode", "ran", "result_check", "swap", "target",
        "wrapper",
    )  # fmt: skip

    def __init__(
        self, wrapper: nn.Module, entry: nn.Module, target: nn.Module, swap: Swap, adapter: Routing,
        fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], around: Around | None,
        result_check: Callable[[nn.Module, Any], None] | None, mode: str,
    ) -> None:  # fmt: skip
        self.wrapper = wrapper  # whose forward the loss must run inside
        self.entry = entry  # what is called: the wrapper, or a layer whose forward runs around it (Fabric's)
        self.target = target  # the module whose forward the wrapper calls: swapped for the dispatch
        self.swap = swap  # the target's swap record
        self.adapter = adapter
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.around = around  # what to enter around the loss; None: nothing (DDP's every step)
        self.result_check = result_check  # the adapter's check of the loss's result, if it has one
        self.mode = mode
        self.ran = False  # set when the wrapper's forward reached the loss: else the wrapper changed the call

    def isolated(self, isolation: Isolating) -> Call:
        """The same call, isolated from the wrapper's compiler pass (the functorch fallback)."""
        around = self.around or Around(None, None, (), ())
        return self._with(self.wrapper, self.entry, self.target, self.swap, around._replace(isolation=isolation))

    def through(self, unit: nn.Module) -> Call:
        """The same loss entered through a nested shard unit's forward, the units after it still to enter."""
        assert self.around is not None  # only a call with nested units gets here
        target = self.adapter.redirect_target(unit)
        around = self.around._replace(nested=self.around.nested[1:])
        return self._with(unit, unit, target, swap_for(target), around)

    def _with(self, wrapper: nn.Module, entry: nn.Module, target: nn.Module, swap: Swap,
              around: Around) -> Call:  # fmt: skip
        return Call(wrapper, entry, target, swap, self.adapter, self.fn, self.args, self.kwargs, around,
                     self.result_check, self.mode)  # fmt: skip

    def __repr__(self) -> str:  # shows up in wrapper error messages; keep it short
        return f"<wrapperroute call of {getattr(self.fn, '__qualname__', type(self.fn).__name__)}>"


def _run_loss(call: Call, kept: Callable[[], contextlib.AbstractContextManager[Any]] | None) -> Any:
    """The loss inside what must be entered around it: the contexts of the target's own instance forward
    (accelerate's autocast), and the adapter's (its hooks set aside and a gather, the functorch isolation, nested
    shard units)."""
    with kept() if kept is not None else NOTHING:
        around = call.around
        if around is None:
            return call.fn(*call.args, **call.kwargs)
        surrounds, isolation = around.surrounds, around.isolation
        with (
            surrounds.around_loss(call.wrapper, around.gather) if surrounds is not None else NOTHING,
            isolation.isolated(call.wrapper) if isolation is not None else NOTHING,
        ):
            if around.nested:  # a shard unit the loss reads from: enter its forward too
                return enter(call.through(around.nested[0]))
            return call.fn(*call.args, **call.kwargs)


def _validate_result(call: Call, result: Any) -> None:
    if type(result) in _LAZY_RESULTS:
        raise RouteTypeError(
            f"fn returned a {type(result).__name__}: its body has not run, so the loss would be "
            "computed later, outside the wrapper's forward. Pass a plain function that returns the "
            "loss (call the async/generator function yourself inside it)."
        )
    if call.result_check is not None:
        call.result_check(call.wrapper, result)


class Swap:
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
        self.saved: object = MISSING  # the target's instance forward we replaced, while swapped
        self.kept: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
        self.kept_source: weakref.ref[Any] | None = None  # the instance forward ``kept`` was read from
        self.wrapper: nn.Module | None = None  # while the passthrough is in
        self.saved_wrapper: object = MISSING  # the wrapper's instance forward it replaced
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


def swap_for(target: nn.Module) -> Swap:
    """The swap record of ``target``: made on first use (registered in ``state.swaps``, dropped with it)."""
    swap: Swap | None = state.swaps.get(id(target))
    if swap is None:
        with state.swaps_lock:
            swap = state.swaps.get(id(target))
            if swap is None:
                swap = state.swaps[id(target)] = Swap(target)
                weakref.finalize(target, state.swaps.pop, id(target), None)
    return swap


def _make_dispatch(target_ref: weakref.ref[nn.Module], swap: Swap) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        call = args[0] if args else None
        if type(call) is not Call or len(args) != 1 or kwargs:
            # Another thread calling the model normally while a loss is routed: behave as the real forward. (A
            # wrapper that changed our call lands here too; enter then says so.)
            target = target_ref()
            if target is None:  # unreachable while the module is being called; keeps the types honest
                raise RouteStateError("the routed module was garbage-collected during its own forward")
            return _original_forward(target, swap.saved)(*args, **kwargs)
        call.ran = True
        wrapper = call.wrapper
        if swap.wrapper is None and id(wrapper) != swap.target_id:
            # The wrapper's passthrough goes in from inside its forward, so our own call of the wrapper never
            # runs through it; the last call out restores it. One per target: a second wrapper over the same
            # module (rare) keeps its own forward, as a second thread's call finds the passthrough in.
            with swap.lock:
                if swap.wrapper is None:
                    swap.last_wrapper = weakref.ref(wrapper)
                    swap.wrapper, swap.saved_wrapper = wrapper, wrapper.__dict__.get("forward", MISSING)
                    wrapper.__dict__["forward"] = swap.passthrough
        routing = state.thread.routing
        key = id(wrapper)
        try:
            routing.add(key)  # a call of the wrapper from the loss is now a plain inner call (passthrough)
            kept = swap.kept
            if kept is None and call.around is None:  # DDP's every step: nothing to enter around the loss
                result = call.fn(*call.args, **call.kwargs)
            else:
                result = _run_loss(call, kept)
        finally:
            routing.discard(key)
        if call.result_check is not None or type(result) in _LAZY_RESULTS:
            _validate_result(call, result)
        return result

    return forward


def _make_passthrough(target_ref: weakref.ref[nn.Module], swap: Swap) -> Callable[..., Any]:
    """The wrapper's ``forward`` while losses run inside it: in a thread running one, calling the wrapper is a
    plain call of the inner module; in any other thread, the wrapper's real forward."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        wrapper = swap.wrapper
        if wrapper is None:
            # Read while it was in (another thread's plain model(...) looked it up, then the last routed call
            # ended): the wrapper's forward is back, so run that. Only a copy kept somewhere else is stale.
            wrapper = swap.last_wrapper() if swap.last_wrapper is not None else None
            if wrapper is None or wrapper.__dict__.get("forward") is forward:
                raise RouteStateError("the routed wrapper was called after its loss ended, through a stale forward")
            return wrapper.forward(*args, **kwargs)
        if id(wrapper) in state.thread.routing:
            target = target_ref()
            if target is None:  # unreachable while a loss runs inside the wrapper
                raise RouteStateError("the routed module was garbage-collected during its own forward")
            return target(*args, **kwargs)
        return _original_forward(wrapper, swap.saved_wrapper)(*args, **kwargs)

    return forward


class RefusedError(RouteStateError):
    """Another thread is inside this wrapper's forward: ``call`` refused before entering anything."""

    def __init__(self, message: str, call: Call) -> None:
        super().__init__(message)
        self.call = call


def enter(call: Call) -> Any:
    """Call ``call.entry`` (the wrapper, or a layer entered around it) with ``call``, whose loss runs in
    ``call.target``'s swapped forward."""
    swap, target = call.swap, call.target
    grad = torch.is_grad_enabled()
    entered = False
    # Ctrl-C (KeyboardInterrupt) can land wherever Python checks for signals: after any call returns, and on
    # entering a Python function. The bookkeeping below is ordered so that no such point lies between a change
    # of state and the cleanup that undoes it (``with``, not acquire(); ``entered`` set with no call since the
    # swap; the restore inline, stores and deletes only). tests/test_route_interrupts.py interrupts every such point.
    try:
        with swap.lock:
            if swap.count:  # another thread is inside this wrapper's forward (one thread never gets here twice)
                adapter = call.adapter
                reason = adapter.concurrency_error(call.wrapper, grad, swap.grad_calls)
                if reason is not None:
                    raise RefusedError(
                        f"another thread is running a routed forward through this {adapter.kind} wrapper right "
                        f"now, and {reason}. Serialise the steps (one lock around route_loss and backward), route "
                        "evaluation calls under torch.no_grad() (DDP), or use separate models on separate process "
                        "groups.",
                        call,
                    )
            else:  # the first call in: swap the target's forward for the dispatch
                saved = swap.saved = target.__dict__.get("forward", MISSING)
                if saved is not MISSING:
                    swap.keep(target, saved)
                elif swap.kept is not None:
                    swap.kept = swap.kept_source = None
                target.__dict__["forward"] = swap.dispatch
            swap.count += 1
            swap.grad_calls += grad
            entered = True
        result = call.entry(call)
    except BaseException as error:
        if entered and not call.ran:  # the wrapper's own error, or a mangled call
            _add_note(
                error,
                f"wrapperroute: raised by the {call.adapter.kind} wrapper before the loss ran (in its pre-forward, or "
                f"because it did not pass wrapperroute's call to {type(target).__name__}.forward unchanged)",
            )
        raise
    finally:
        if entered:
            with swap.lock:
                swap.count -= 1
                swap.grad_calls -= grad
                if not swap.count:  # the last call out puts the original forwards back (written out: no call)
                    forwards = target.__dict__
                    if swap.saved is not MISSING:
                        forwards["forward"] = swap.saved
                    elif "forward" in forwards:
                        del forwards["forward"]
                    swap.saved = MISSING
                    passed = swap.wrapper
                    if passed is not None:
                        forwards = passed.__dict__
                        if swap.saved_wrapper is not MISSING:
                            forwards["forward"] = swap.saved_wrapper
                        elif "forward" in forwards:
                            del forwards["forward"]
                        swap.wrapper, swap.saved_wrapper = None, MISSING
    if not call.ran:
        raise _call_lost(target)
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


def _call_lost(target: nn.Module) -> RouteStateError:
    return RouteStateError(
        f"the wrapper returned without running the loss: it did not pass wrapperroute's call to "
        f"{type(target).__name__}.forward unchanged. Report this wrapper; meanwhile compute the loss through "
        "model(...) directly."
    )
