"""``route_loss``: run a loss inside the distributed wrapper's forward.

How: the wrapper's forward calls one inner module (``ddp.module``, ``fsdp._fsdp_wrapped_module``, the FSDP2
root itself, ``engine.module``). For the length of one call we give that module an instance ``forward`` that
runs the loss, then call the wrapper with a single opaque token. The wrapper does everything it does in a real
forward (arms DDP's reducer, unshards FSDP units, gathers ZeRO-3 parameters) around the loss.

Why a token and not the loss's arguments: wrappers move, cast and scatter their inputs (DDP's ``_to_kwargs``,
FSDP2's mixed-precision cast), and with DDP ``device_ids`` set a call with no argument at all fails. The payload
travels in the token, untouched, and each call carries its own, so two threads routing through one model never
see each other's loss.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from ._kept import kept_forward_context
from .adapters import Adapter
from .detect import Detection, detect, plain_types
from .errors import RouteStateError, RouteTypeError, RouteValueError

T = TypeVar("T")
Mode = Literal["auto", "redirect", "isolate"]
MODES: tuple[str, ...] = ("auto", "redirect", "isolate")

log = logging.getLogger("wrapperroute")

_MISSING = object()


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.routing: set[int] = set()  # ids of wrappers whose forward is running a loss in this thread
        self.pending: dict[int, _Call] = {}  # id(target) -> call handed to the wrapper, not yet dispatched


_thread = _ThreadState()

# Code objects (or callable types) of losses that failed under DDP's graph optimizer: routed isolated from
# then on, so the failure and the retry happen once per process, not once per step.
_isolated_losses: set[object] = set()


class _Call:
    """The token handed to the wrapper: the loss and everything needed to run it inside the forward."""

    __slots__ = ("adapter", "args", "fn", "gather", "isolate", "kwargs", "nested", "target", "wrapper")

    def __init__(
        self,
        wrapper: nn.Module,
        adapter: Adapter,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        isolate: bool,
        gather: tuple[nn.Module, ...],
        nested: tuple[nn.Module, ...],
        target: nn.Module,
    ) -> None:
        self.wrapper = wrapper
        self.target = target
        self.adapter = adapter
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.isolate = isolate
        self.gather = gather
        self.nested = nested

    def run(self) -> Any:
        wrapper = self.wrapper
        routing = _thread.routing
        routing.add(id(wrapper))
        # While the loss runs, a call of the wrapper itself (fn calling model(...)) is a plain call of the inner
        # module: the wrapper is already prepared, and its pre/post-forward again would re-arm DDP's reducer or
        # reshard FSDP parameters mid-loss. (FSDP2's wrapper is the module itself: its adapter sets hooks aside.)
        target = self.target
        passthrough = target is not wrapper
        if passthrough:
            saved = wrapper.__dict__.get("forward", _MISSING)
            wrapper.__dict__["forward"] = target
        try:
            with self.adapter.inside(wrapper, isolate=self.isolate, gather=self.gather):
                if self.nested:  # a shard unit the loss reads from: enter its forward too
                    unit, rest = self.nested[0], self.nested[1:]
                    return _call_through(
                        unit, self.adapter, self.fn, self.args, self.kwargs, self.isolate, self.gather, rest
                    )
                return self.fn(*self.args, **self.kwargs)
        finally:
            if passthrough:
                if saved is _MISSING:
                    del wrapper.__dict__["forward"]
                else:
                    wrapper.__dict__["forward"] = saved
            routing.discard(id(wrapper))

    def __repr__(self) -> str:  # shows up in wrapper error messages; keep it short
        return f"<wrapperroute call of {getattr(self.fn, '__qualname__', type(self.fn).__name__)}>"


class _Redirection:
    """The swapped ``forward`` of one target module, shared by every in-flight call on it (refcounted).

    Built once per target and kept while the target lives; it holds the target only weakly.
    """

    __slots__ = ("count", "dispatch", "kept", "kept_source", "lock", "saved")

    def __init__(self, target: nn.Module) -> None:
        self.lock = threading.Lock()
        self.count = 0
        self.saved: object = _MISSING  # the instance forward we replaced, while swapped
        self.kept: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
        self.kept_source: weakref.ref[Any] | None = None  # the instance forward ``kept`` was read from
        self.dispatch = _make_dispatch(weakref.ref(target), self)


_redirections: dict[int, _Redirection] = {}
_redirections_lock = threading.Lock()


def _redirection_for(target: nn.Module) -> _Redirection:
    state = _redirections.get(id(target))
    if state is None:
        with _redirections_lock:
            state = _redirections.get(id(target))
            if state is None:
                state = _redirections[id(target)] = _Redirection(target)
                weakref.finalize(target, _redirections.pop, id(target), None)
    return state


def _make_dispatch(target_ref: weakref.ref[nn.Module], state: _Redirection) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        target = target_ref()
        if target is None:  # unreachable while the module is being called; keeps the types honest
            raise RouteStateError("the routed module was garbage-collected during its own forward")
        if len(args) == 1 and not kwargs and type(args[0]) is _Call:
            _thread.pending.pop(id(target), None)
            kept = state.kept
            if kept is None:
                return args[0].run()
            with kept():
                return args[0].run()
        if id(target) in _thread.pending:
            raise RouteStateError(
                f"the wrapper did not pass wrapperroute's call token to {type(target).__name__}.forward "
                "unchanged, so the loss cannot run inside its forward. Report this wrapper; meanwhile compute "
                "the loss through model(...) directly."
            )
        # Another thread calling the model normally while a loss is routed: behave as the real forward.
        saved = state.saved
        original = saved if saved is not _MISSING else type(target).forward.__get__(target)
        return original(*args, **kwargs)  # type: ignore[operator]

    return forward


def _saved_tensor_hooks_enabled() -> bool:
    probe = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    return bool(probe()) if probe is not None else True


def _fallback_key(fn: Callable[..., Any]) -> object:
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    return getattr(fn, "__code__", None) or type(fn)


def _is_graph_optimizer_failure(error: BaseException) -> bool:
    """The DDP graph optimizer split a graph inside a torch.func transform (see adapters/ddp.py)."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if "TensorWrapper" in str(current):
            return True
        pending += [current.__cause__, current.__context__, getattr(current, "inner_exception", None)]
    return False


def _as_gather(gather: nn.Module | Iterable[nn.Module] | None) -> tuple[nn.Module, ...]:
    if gather is None:
        return ()
    if isinstance(gather, nn.Module):
        return (gather,)
    modules = tuple(gather)
    for module in modules:
        if not isinstance(module, nn.Module):
            raise RouteTypeError(
                f"gather= takes nn.Module objects (e.g. [unwrapped.lm_head]), got {type(module).__name__}"
            )
    return modules


def _check_inside(found: Detection, unwrapped: nn.Module, role: str) -> None:
    if not isinstance(unwrapped, nn.Module):
        raise RouteTypeError(
            f"{role} must be an nn.Module or None, got {type(unwrapped).__name__}; pass the model your loss "
            "reads (e.g. accelerator.unwrap_model(model)), or None to let wrapperroute find it"
        )
    if unwrapped is found.inner:
        return
    if any(
        layer is unwrapped and kind in ("ddp", "fsdp1", "fsdp2", "deepspeed")
        for layer, kind in zip(found.layers, found.chain, strict=True)
    ):
        raise RouteValueError(
            f"{role} is the {found.kind!r} wrapper layer itself, not the module inside it; a loss that calls it "
            f"would enter the wrapper twice. Pass wrapperroute.detect(model).inner (or None) instead."
        )
    if any(layer is unwrapped for layer in found.layers):
        return
    if not any(sub is unwrapped for sub in found.inner.modules()):
        raise RouteValueError(
            f"{role} ({type(unwrapped).__name__}) is not inside model ({type(found.layers[0]).__name__}): "
            "the wrapper cannot prepare parameters it does not own. Pass the module unwrapped from this model "
            "(e.g. accelerator.unwrap_model(model) or model.module), or None."
        )


class _Plan:
    """What route_loss learns about one model object once: its detection and the modules checked to be
    inside it. Kept while the model lives (held weakly) and while its class stays the same (fully_shard
    changes a module's class)."""

    __slots__ = ("checked", "found", "model_ref", "model_type")

    def __init__(self, model: nn.Module) -> None:
        self.found = detect(model)  # first: it names a non-module argument clearly
        self.model_ref = weakref.ref(model)
        self.model_type = type(model)
        self.checked: dict[int, weakref.ref[nn.Module]] = {}

    def check_inside(self, module: nn.Module, role: str) -> None:
        known = self.checked.get(id(module))
        if known is not None and known() is module:
            return
        _check_inside(self.found, module, role)
        self.checked[id(module)] = weakref.ref(module)


_plans: dict[int, _Plan] = {}


def _plan_for(model: nn.Module) -> _Plan:
    plan = _plans.get(id(model))
    if plan is not None and plan.model_ref() is model and plan.model_type is type(model):
        return plan
    plan = _Plan(model)
    if id(model) not in _plans:
        weakref.finalize(model, _plans.pop, id(model), None)
    _plans[id(model)] = plan
    return plan


def route_loss(
    model: nn.Module,
    unwrapped: nn.Module | None,
    fn: Callable[..., T],
    *args: Any,
    mode: Mode = "auto",
    gather: nn.Module | Iterable[nn.Module] | None = None,
    **kwargs: Any,
) -> T:
    """Call ``fn(*args, **kwargs)`` inside ``model``'s distributed-wrapper forward and return its result.

    Gradients of a loss returned this way are what the wrapper would produce for a normal ``model(...)``
    forward: all-reduced by DDP, reduce-scattered by FSDP, partitioned by ZeRO-3. With no distributed wrapper
    (one process, a plain module) ``fn`` is simply called.

    Args:
        model: what the trainer holds: a DDP/FSDP/DeepSpeed wrapper, possibly under ``torch.compile``.
        unwrapped: the inner module ``fn`` reads (``model.module``, ``accelerator.unwrap_model(model)``), or
            ``None`` to skip the containment check. It is validated, not used: ``fn`` closes over it.
        fn: the loss. Its arguments travel by reference, never through the wrapper, so they are neither
            moved, cast nor scattered. It may return any pytree (tensor, tuple, dict, ``ModelOutput``).
        mode: ``"auto"`` (default) runs ``fn`` in the forward; if DDP's graph optimizer fails on a
            ``torch.func`` loss ("Cannot access storage of TensorWrapper"), ``fn`` is run once more isolated
            from that optimizer, and that loss stays isolated for the rest of the process. ``"isolate"``
            isolates from the first call (use it when ``fn`` has side effects before its first compiled
            call). ``"redirect"`` never isolates.
        gather: modules whose parameters ``fn`` reads directly and that live in their own shard unit (FSDP)
            or partition (ZeRO-3), e.g. ``[unwrapped.lm_head]``; ignored by replicated wrappers.

    Keyword arguments named ``mode`` or ``gather`` are taken by ``route_loss``; pass such arguments to ``fn``
    with ``functools.partial``.
    """
    if not callable(fn):
        raise RouteTypeError(
            f"fn must be callable (the loss to run inside the wrapper), got {type(fn).__name__}; "
            "pass the function itself, not its result"
        )
    if mode not in MODES:
        raise RouteValueError(f"mode must be one of {MODES}, got {mode!r}")
    if type(model) in plain_types and gather is None and (unwrapped is None or unwrapped is model):
        return fn(*args, **kwargs)  # a plain module, already seen by detect: nothing to route through
    plan = _plan_for(model)
    found = plan.found
    if unwrapped is not None and unwrapped is not found.inner:
        plan.check_inside(unwrapped, "unwrapped")
    modules = _as_gather(gather)
    for module in modules:
        plan.check_inside(module, "a gather= entry")
    wrapper, adapter = found.wrapper, found.adapter
    if wrapper is None or adapter is None:
        return fn(*args, **kwargs)
    if id(wrapper) in _thread.routing or adapter.in_forward(wrapper):
        # Already inside this wrapper's forward: it is armed for this step; entering again would clobber it.
        return fn(*args, **kwargs)
    adapter.validate_gather(wrapper, modules)
    nested = adapter.nested_units(wrapper, modules)

    key = _fallback_key(fn)
    isolate = mode == "isolate" or (mode == "auto" and key in _isolated_losses)
    hooks_enabled = _saved_tensor_hooks_enabled()
    try:
        return _call_through(wrapper, adapter, fn, args, kwargs, isolate, modules, nested)
    except Exception as error:
        # A compile that failed inside a torch.func transform leaves it half-run; entering it disabled
        # saved-tensor hooks, and everything after (the retry, gradient checkpointing) would fail without them.
        if hooks_enabled and not _saved_tensor_hooks_enabled():
            torch._C._autograd._saved_tensors_hooks_enable()
        if mode != "auto" or isolate or not _is_graph_optimizer_failure(error):
            raise
    _isolated_losses.add(key)
    log.warning(
        "wrapperroute: %s failed under DDP's graph optimizer (a torch.func loss split across buckets); "
        "running it isolated from that optimizer from now on. Pass mode='isolate' to skip the first attempt.",
        getattr(fn, "__qualname__", type(fn).__name__),
    )
    return _call_through(wrapper, adapter, fn, args, kwargs, True, modules, nested)


def _call_through(
    wrapper: nn.Module,
    adapter: Adapter,
    fn: Callable[..., T],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    isolate: bool,
    gather: tuple[nn.Module, ...],
    nested: tuple[nn.Module, ...] = (),
) -> T:
    target = adapter.redirect_target(wrapper)
    call = _Call(wrapper, adapter, fn, args, kwargs, isolate, gather, nested, target)
    state = _redirection_for(target)
    with state.lock:
        if state.count == 0:
            saved = target.__dict__.get("forward", _MISSING)
            state.saved = saved
            if saved is _MISSING:
                state.kept = state.kept_source = None
            elif state.kept_source is None or state.kept_source() is not saved:
                state.kept = kept_forward_context(target, saved)  # read once per distinct instance forward
                try:
                    state.kept_source = weakref.ref(saved)
                except TypeError:  # not weakly referenceable: read it again next time
                    state.kept_source = None
            target.__dict__["forward"] = state.dispatch
        state.count += 1
    pending = _thread.pending
    pending[id(target)] = call
    try:
        result: T = wrapper(call)
        return result
    finally:
        pending.pop(id(target), None)
        with state.lock:
            state.count -= 1
            if state.count == 0:
                if state.saved is _MISSING:
                    target.__dict__.pop("forward", None)
                else:
                    target.__dict__["forward"] = state.saved
                state.saved = _MISSING
