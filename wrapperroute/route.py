"""``route_loss``: run a loss inside the distributed wrapper's forward.

How: for the length of one call, the module the wrapper's forward calls gets an instance ``forward`` that runs
the loss, and the wrapper is called with one opaque token carrying it (``_swap.py``). The wrapper does
everything it does in a real forward (arms DDP's reducer, unshards FSDP units, gathers ZeRO-3 parameters)
around the loss. What is learnt about a model once lives in its plan (``_plan.py``); the functorch fallback
in ``_fallback.py``; what happens after a loss that raised in ``_faults.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from ._fallback import _fallback_key, _is_graph_optimizer_failure, _isolated_losses, _saved_tensor_hooks_enabled
from ._faults import _agree, _recover
from ._plan import _as_gather, _new_plan, _plans
from ._swap import _enter_wrapper, _Inside, _RefusedError, _thread, _Token
from .errors import RouteStateError, RouteTypeError, RouteValueError

T = TypeVar("T")
Mode = Literal["auto", "redirect", "isolate"]
MODES: tuple[str, ...] = ("auto", "redirect", "isolate")

log = logging.getLogger("wrapperroute")

__all__ = ["MODES", "Mode", "route_loss"]


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
    plan = _plans.get(id(model))
    # The step's common case: a plan for this model (dropped with it) whose class and wrapper are unchanged.
    wrapper = plan.wrapper_ref() if plan is not None and plan.model_type is type(model) else None
    if wrapper is None or plan is None:  # a first call, a changed model, or a model with no distributed wrapper
        if (plan is not None and plan.plain and plan.model_type is type(model) and gather is None
                and (unwrapped is None or unwrapped is model)):  # fmt: skip
            return fn(*args, **kwargs)  # a plain module already planned (and spoken of): nothing to route through
        if plan is None or not plan.current(model):
            plan = _new_plan(model)
        wrapper = plan.wrapper_ref()
    if unwrapped is not None and unwrapped is not plan.inner_ref():
        plan.validate_inside(model, unwrapped, "unwrapped")
    modules = () if gather is None else _as_gather(gather)
    for module in modules:
        plan.validate_inside(model, module, "a gather= entry")
    adapter, state = plan.adapter, plan.state
    if wrapper is None or adapter is None or state is None:
        return fn(*args, **kwargs)
    if state.count:  # calls of ours in flight on this target: is this thread's loss one of them?
        if id(wrapper) in _thread.routing:
            # Already inside this wrapper's forward: it is armed for this step; entering again would clobber it.
            return fn(*args, **kwargs)
    elif adapter.in_forward(wrapper):
        # This thread is inside the wrapper's own forward (fn routed from the model's forward): armed already,
        # so a plain call. (With calls of ours in flight, the flag may be another thread's: _enter_wrapper's
        # concurrency check decides.)
        return fn(*args, **kwargs)
    elif plan.repairs:
        adapter.repair(wrapper)
    if not dist.is_initialized() and adapter.distributed:
        raise RouteStateError(
            f"model is a {plan.kind!r} wrapper but torch.distributed has no process group (never initialised, "
            "or destroyed): its forward cannot synchronise anything. Call torch.distributed.init_process_group "
            "before routing (and keep it until the last step), or route the unwrapped model without a wrapper."
        )
    nested: tuple[nn.Module, ...] = ()
    if modules or plan.picks_units:
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
    inside = None if plan.nothing_inside and not (isolate or modules or nested) else _Inside(adapter, isolate, modules,
                                                                                             nested)  # fmt: skip
    target = plan.target_ref()
    callee = plan.callee_ref()  # the wrapper, or Fabric's module entered around it
    hooks_enabled = _saved_tensor_hooks_enabled()
    try:
        call = _Token(wrapper, fn, args, kwargs, inside, plan.result_check)
        return _enter_wrapper(wrapper, adapter, target, state, call, callee)
    except _RefusedError:
        raise  # nothing was entered; the wrapper belongs to the thread inside it: leave it alone
    except BaseException as error:  # KeyboardInterrupt too: a notebook user may go on training
        _recover(adapter, wrapper)
        # A compile that failed inside a torch.func transform leaves it half-run; entering it disabled
        # saved-tensor hooks, and everything after (the retry, gradient checkpointing) would fail without them.
        if hooks_enabled and not _saved_tensor_hooks_enabled():
            torch._C._autograd._saved_tensors_hooks_enable()
        if (
            not isinstance(error, Exception)
            or mode != "auto"
            or isolate
            or not adapter.isolates  # FSDP, DeepSpeed: an isolated rerun would be the same call again
            or not _is_graph_optimizer_failure(error)
        ):
            raise
    # The functorch fallback: the same loss once more, isolated from DDP's graph optimizer (adapters/ddp.py).
    _isolated_losses.add(_fallback_key(fn))
    log.warning(
        "wrapperroute: %s failed under DDP's graph optimizer (a torch.func loss split across buckets); "
        "running it isolated from that optimizer from now on. Pass mode='isolate' to skip the first attempt.",
        getattr(fn, "__qualname__", type(fn).__name__),
    )
    try:
        call = _Token(wrapper, fn, args, kwargs, _Inside(adapter, True, modules, nested), plan.result_check)
        return _enter_wrapper(wrapper, adapter, target, state, call, callee)
    except BaseException:
        _recover(adapter, wrapper)
        raise
