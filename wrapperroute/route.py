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
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ._kept import kept_forward_context
from ._unrouted import speak_up
from .adapters import Adapter, registered
from .adapters.base import NOTHING
from .detect import Detection, detect, plain_types
from .errors import RouteStateError, RouteTypeError, RouteValueError

T = TypeVar("T")
Mode = Literal["auto", "redirect", "isolate"]
MODES: tuple[str, ...] = ("auto", "redirect", "isolate")

log = logging.getLogger("wrapperroute")

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

# Code objects (or callable types) of losses that failed under DDP's graph optimizer: routed isolated from
# then on, so the failure and the retry happen once per process, not once per step.
_isolated_losses: set[object] = set()


class _Call:
    """The token handed to the wrapper: the loss and everything needed to run it inside the forward."""

    __slots__ = ("args", "check", "extra", "fn", "kwargs", "ran", "wrapper")

    def __init__(
        self,
        wrapper: nn.Module,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        extra: tuple[Adapter, bool, tuple[nn.Module, ...], tuple[nn.Module, ...]] | None,
        check: Callable[[nn.Module, Any], None] | None,
    ) -> None:
        self.wrapper = wrapper
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.extra = extra  # (adapter, isolate, gather, nested units) for adapter.inside; None: nothing to enter
        self.check = check  # the adapter's result check, if it has one
        self.ran = False  # set when the wrapper's forward reached the loss: else the wrapper changed the token

    def __repr__(self) -> str:  # shows up in wrapper error messages; keep it short
        return f"<wrapperroute call of {getattr(self.fn, '__qualname__', type(self.fn).__name__)}>"


def _run_entered(call: _Call, kept: Callable[[], contextlib.AbstractContextManager[Any]] | None) -> Any:
    """The loss inside what must be entered around it: the contexts of the target's own instance forward
    (accelerate's autocast), and the adapter's (a gather, the functorch isolation, nested shard units)."""
    with kept() if kept is not None else NOTHING:
        if call.extra is None:
            return call.fn(*call.args, **call.kwargs)
        adapter, isolate, gather, nested = call.extra
        with adapter.inside(call.wrapper, isolate=isolate, gather=gather):
            if nested:  # a shard unit the loss reads from: enter its forward too
                rest = (adapter, isolate, gather, nested[1:])
                return _call_through(nested[0], adapter, None, None, call.fn, call.args, call.kwargs, rest, call.check)
            return call.fn(*call.args, **call.kwargs)


def _check_result(call: _Call, result: Any) -> None:
    if type(result) in _LAZY_RESULTS:
        raise RouteTypeError(
            f"fn returned a {type(result).__name__}: its body has not run, so the loss would be "
            "computed later, outside the wrapper's forward. Pass a plain function that returns the "
            "loss (call the async/generator function yourself inside it)."
        )
    if call.check is not None:
        call.check(call.wrapper, result)


class _Redirection:
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
        call = args[0] if args else None
        if type(call) is not _Call or len(args) != 1 or kwargs:
            # Another thread calling the model normally while a loss is routed: behave as the real forward. (A
            # wrapper that changed our token lands here too; _call_through then says so.)
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
                result = _run_entered(call, kept)
        finally:
            routing.discard(key)
        if call.check is not None or type(result) in _LAZY_RESULTS:
            _check_result(call, result)
        return result

    return forward


def _make_passthrough(target_ref: weakref.ref[nn.Module], state: _Redirection) -> Callable[..., Any]:
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


# Called before every routed step (only its error path reads it): the C function itself, not a wrapper.
_saved_tensor_hooks_enabled: Callable[[], bool] = getattr(
    torch._C._autograd, "_saved_tensors_hooks_is_enabled", lambda: True
)


def _fallback_key(fn: Callable[..., Any]) -> object:
    code = getattr(fn, "__code__", None)
    if code is not None:  # a plain function or lambda: the common case
        return code
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
    if isinstance(gather, str):
        raise RouteTypeError(
            f"gather= takes modules, not names: got {gather!r}; pass unwrapped.get_submodule({gather!r})"
        )
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
        layer is unwrapped and any(adapter.kind == kind and adapter.distributed for adapter in registered())
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


def _no_wrapper() -> None:
    return None


class _Plan:
    """What route_loss learns about one model object once: the wrapper to call, its adapter, the module whose
    forward is swapped, and the modules already checked to be inside the model.

    Every module is held weakly: a plan must never keep a model (its parameters, its GPU memory) alive. It is
    dropped with the model, and rebuilt when the model's class changes (fully_shard changes it), a wrapper it
    names is gone, or, for a model without a wrapper, the inner module's class changes. (A layer swapped for
    another while the old one lives on elsewhere is not noticed: route the new model object.)
    """

    __slots__ = ("adapter", "check", "checked", "entry_ref", "inner_ref", "inner_type", "kind", "lasting",
                 "model_ref", "model_type", "plain", "replicated", "state", "target_ref", "wrapper_ref")  # fmt: skip

    def __init__(self, model: nn.Module) -> None:
        found = detect(model)  # first: it names a non-module argument clearly
        self.model_ref = weakref.ref(model)
        self.model_type = type(model)
        self.kind = found.kind
        self.inner_ref = weakref.ref(found.inner)
        self.inner_type = type(found.inner)
        wrapper, adapter = found.wrapper, found.adapter
        self.lasting = True  # False: answered for this call only, not kept (see _unrouted.speak_up)
        if wrapper is None:
            self.lasting = speak_up(model, found)
            # No distributed wrapper, but a layer whose forward must still run (Fabric on one device): route
            # through that layer alone.
            wrapper, adapter = found.entry, found.entry_adapter
        self.wrapper_ref: Callable[[], nn.Module | None] = _no_wrapper
        self.entry_ref: Callable[[], nn.Module | None] = _no_wrapper  # called instead of the wrapper, if set
        if found.entry is not None and found.entry is not wrapper:
            self.entry_ref = weakref.ref(found.entry)
        self.adapter = adapter
        self.target_ref: Callable[[], nn.Module | None] = _no_wrapper
        self.state: _Redirection | None = None
        self.plain = self.replicated = False
        self.check: Callable[[nn.Module, Any], None] | None = None
        if wrapper is not None and adapter is not None:
            # nn.Module attribute lookups of submodules (``ddp.module``) cost a microsecond: once per model.
            target = adapter.redirect_target(wrapper)
            self.wrapper_ref, self.target_ref = weakref.ref(wrapper), weakref.ref(target)
            self.state = _redirection_for(target)
            # Neither gather= checks nor shard units to pick (DDP): skip those two calls on every step.
            kind = type(adapter)
            self.replicated = (
                kind.validate_gather is Adapter.validate_gather and kind.nested_units is Adapter.nested_units
            )
            # Nothing to enter around a plain call's loss (DDP): not asked again on such calls.
            self.plain = adapter.inside(wrapper, isolate=False, gather=()) is NOTHING
            self.check = adapter.result_check(wrapper)
        self.checked: dict[int, weakref.ref[nn.Module]] = {}

    def current(self, model: nn.Module) -> bool:
        """Still this model's plan: same object and class, and a wrapper it names alive (with none, the inner
        module's class unchanged: fully_shard after a first call through a torch.compile or PEFT layer)."""
        if self.model_ref() is not model or self.model_type is not type(model):
            return False
        if self.state is not None:
            return self.wrapper_ref() is not None
        return type(self.inner_ref()) is self.inner_type

    def check_inside(self, model: nn.Module, module: nn.Module, role: str) -> None:
        known = self.checked.get(id(module))
        if known is not None and known() is module:
            return
        _check_inside(detect(model), module, role)
        self.checked[id(module)] = weakref.ref(module)


_plans: dict[int, _Plan] = {}
# id -> class of the planned models with nothing to route through (and already spoken of): route_loss's fast
# path, one dict lookup. A class change (fully_shard after a first call) misses it and plans again.
_plain_models: dict[int, type] = {}


def _forget(key: int) -> None:
    _plans.pop(key, None)
    _plain_models.pop(key, None)


def _new_plan(model: nn.Module) -> _Plan:
    plan = _Plan(model)
    if not plan.lasting:
        return plan
    key = id(model)
    if key not in _plans:
        weakref.finalize(model, _forget, key)
    _plans[key] = plan
    if plan.state is None and type(model) in plain_types:
        _plain_models[key] = type(model)
    return plan


def route_loss(
    model: nn.Module,
    unwrapped: nn.Module | None,
    fn: Callable[..., T],
    *args: Any,
    mode: Mode = "auto",
    gather: nn.Module | Iterable[nn.Module] | None = None,
    agree: bool = False,
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
        agree: after ``fn`` (raised or not), every rank of the wrapper's process group exchanges one success
            flag (one small all-reduce on a side group, so it never pairs with the wrapper's own collectives).
            If ``fn`` failed on any rank, every rank raises :class:`RouteStateError` naming the failed ranks
            (chained to the error on the ranks where it happened) instead of the others hanging in the
            backward's collectives. Off by default: it costs one collective per step. Without it, a failure on
            one rank is bounded only by the process group's timeout (``init_process_group(timeout=...)``).

    If ``fn`` raises, the wrapper is returned to its between-steps state (forward restored, FSDP units
    resharded and idle, ZeRO-3 parameters released; FSDP2 ``no_sync`` accumulation of the failed step is
    discarded, as ``reset_iter_state`` does) and the error propagates: the next step is exact.

    Legitimate and routed as usual: ``torch.no_grad()`` (an evaluation loss: FSDP still unshards, DDP does not
    arm its reducer), a model in ``eval()`` mode, and a call from inside the wrapper's own forward (``fn`` is
    then called directly: the wrapper is already prepared). Two threads may route through one DDP model at
    once when at most one of them records a graph; any other concurrent use of one wrapper raises
    :class:`RouteStateError`.

    Keyword arguments named ``mode``, ``gather`` or ``agree`` are taken by ``route_loss``; pass such arguments
    to ``fn`` with ``functools.partial``.
    """
    if not callable(fn):
        raise RouteTypeError(
            f"fn must be callable (the loss to run inside the wrapper), got {type(fn).__name__}; "
            "pass the function itself, not its result"
        )
    if mode != "auto" and mode not in MODES:
        raise RouteValueError(f"mode must be one of {MODES}, got {mode!r}")
    if gather is None and _plain_models.get(id(model)) is type(model) and (unwrapped is None or unwrapped is model):
        return fn(*args, **kwargs)  # a plain module already planned (and spoken of): nothing to route through
    plan = _plans.get(id(model))
    # The step's common case: a plan for this model (dropped with it) whose class and wrapper are unchanged.
    wrapper = plan.wrapper_ref() if plan is not None and plan.model_type is type(model) else None
    if wrapper is None or plan is None:  # a first call, a changed model, or a model with no distributed wrapper
        if plan is None or not plan.current(model):
            plan = _new_plan(model)
        wrapper = plan.wrapper_ref()
    if unwrapped is not None and unwrapped is not plan.inner_ref():
        plan.check_inside(model, unwrapped, "unwrapped")
    modules = () if gather is None else _as_gather(gather)
    for module in modules:
        plan.check_inside(model, module, "a gather= entry")
    adapter, state = plan.adapter, plan.state
    if wrapper is None or adapter is None or state is None:
        return fn(*args, **kwargs)
    if state.count:  # calls of ours in flight on this target: is this thread's loss one of them?
        if id(wrapper) in _thread.routing:
            # Already inside this wrapper's forward: it is armed for this step; entering again would clobber it.
            return fn(*args, **kwargs)
    elif adapter.in_forward(wrapper):
        # This thread is inside the wrapper's own forward (fn routed from the model's forward): armed already,
        # so a plain call. (With calls of ours in flight, the flag may be another thread's: _call_through's
        # concurrency check decides.)
        return fn(*args, **kwargs)
    if not dist.is_initialized() and adapter.distributed:
        raise RouteStateError(
            f"model is a {plan.kind!r} wrapper but torch.distributed has no process group (never initialised, "
            "or destroyed): its forward cannot synchronise anything. Call torch.distributed.init_process_group "
            "before routing (and keep it until the last step), or route the unwrapped model without a wrapper."
        )
    nested: tuple[nn.Module, ...] = ()
    if modules or not plan.replicated:
        adapter.validate_gather(wrapper, modules)
        nested = adapter.nested_units(wrapper, modules)
    if agree:  # the same call, then one flag exchanged, raised or not
        try:
            # gather as the tuple already read: an iterator passed in is used up
            result = route_loss(model, unwrapped, fn, *args, mode=mode, gather=modules or None, **kwargs)
        except BaseException as error:
            _agree(adapter, wrapper, error)
            raise
        _agree(adapter, wrapper, None)
        return result
    isolate = mode == "isolate" or (bool(_isolated_losses) and mode == "auto" and _fallback_key(fn) in _isolated_losses)
    extra = None if plan.plain and not (isolate or modules or nested) else (adapter, isolate, modules, nested)
    target = plan.target_ref()
    hooks_enabled = _saved_tensor_hooks_enabled()
    try:
        return _call_through(wrapper, adapter, target, state, fn, args, kwargs, extra, plan.check, plan.entry_ref())
    except _RefusedError:
        raise  # nothing was entered; the wrapper belongs to the thread inside it: leave it alone
    except BaseException as error:  # KeyboardInterrupt too: a notebook user may go on training
        _recover(adapter, wrapper)
        # A compile that failed inside a torch.func transform leaves it half-run; entering it disabled
        # saved-tensor hooks, and everything after (the retry, gradient checkpointing) would fail without them.
        if hooks_enabled and not _saved_tensor_hooks_enabled():
            torch._C._autograd._saved_tensors_hooks_enable()
        if not isinstance(error, Exception) or mode != "auto" or isolate or not _is_graph_optimizer_failure(error):
            raise
    # The functorch fallback: the same loss once more, isolated from DDP's graph optimizer (adapters/ddp.py).
    _isolated_losses.add(_fallback_key(fn))
    log.warning(
        "wrapperroute: %s failed under DDP's graph optimizer (a torch.func loss split across buckets); "
        "running it isolated from that optimizer from now on. Pass mode='isolate' to skip the first attempt.",
        getattr(fn, "__qualname__", type(fn).__name__),
    )
    try:
        isolated = (adapter, True, modules, nested)
        return _call_through(wrapper, adapter, target, state, fn, args, kwargs, isolated, plan.check, plan.entry_ref())
    except BaseException:
        _recover(adapter, wrapper)
        raise


class _RefusedError(RouteStateError):
    """Another thread is inside this wrapper's forward: refused before entering anything."""


def _recover(adapter: Adapter, wrapper: nn.Module) -> None:
    try:
        adapter.recover(wrapper)
    except Exception:  # never mask the loss's own error; say loudly that the wrapper may be unusable
        log.exception("wrapperroute: could not reset the %s wrapper after a failed step", adapter.kind)


# (id of the wrapper's process group or None, its rank tuple) -> the side group agreement runs on
_agree_groups: dict[tuple[int, tuple[int, ...]], Any] = {}


def _agree(adapter: Adapter, wrapper: nn.Module, error: BaseException | None) -> None:
    """Exchange one success flag with every rank of the wrapper's group; raise if any rank failed.

    On a side group (created once per wrapper group, by its members only), so a rank that failed before one of
    the wrapper's own collectives never pairs this all-reduce with that collective.
    """
    group = adapter.process_group(wrapper)
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    key = (id(group), ranks)
    side = _agree_groups.get(key)
    if side is None:
        side = _agree_groups[key] = dist.new_group(list(ranks), use_local_synchronization=True)
    backend = str(dist.get_backend(side))
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    flags = torch.zeros(len(ranks), dtype=torch.int32, device=device)
    flags[ranks.index(dist.get_rank())] = error is not None
    dist.all_reduce(flags, group=side)
    failed = [rank for rank, flag in zip(ranks, flags.tolist(), strict=True) if flag]
    if not failed:
        return
    if error is None:  # our step ran to the end: reset as the failed ranks did, so every rank's state matches
        _recover(adapter, wrapper)
    here = dist.get_rank()
    what = f"{type(error).__name__}: {error}" if error is not None else "none here"
    raise RouteStateError(
        f"route_loss failed on rank(s) {failed} of {list(ranks)} (this is rank {here}; its error: {what}). Every "
        "rank stops here instead of waiting in the backward's collectives; the wrapper is reset and usable. "
        "See the failed ranks' tracebacks for the cause."
    ) from error


def _call_through(
    wrapper: nn.Module,
    adapter: Adapter,
    target: nn.Module | None,
    state: _Redirection | None,
    fn: Callable[..., T],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    extra: tuple[Adapter, bool, tuple[nn.Module, ...], tuple[nn.Module, ...]] | None,
    check: Callable[[nn.Module, Any], None] | None,
    entry: nn.Module | None = None,
) -> T:
    """Call ``entry`` (else ``wrapper``) with a token whose loss runs in ``target``'s swapped forward."""
    if target is None or state is None:  # a nested shard unit: looked up per call (FSDP1, not the hot path)
        target = adapter.redirect_target(wrapper)
        state = _redirection_for(target)
    call = _Call(wrapper, fn, args, kwargs, extra, check)
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
        result: T = (wrapper if entry is None else entry)(call)
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
