"""What to call: what ``route_loss`` learns about one model once (its plan), the checks of ``unwrapped`` and
``gather=`` against it, and the routed call built from them (or None: call the loss plainly). Plans hold every
module weakly and are dropped with the model."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any, Literal, get_args

import torch.distributed as dist
from torch import nn

from ..adapters import AroundLoss, Isolating, Routing, ShardUnits, Topology
from ..adapters.registry import on_change
from ..detect import Detection, detect, plain_types
from ..errors import RouteStateError, RouteTypeError, RouteValueError
from . import state
from .run import fallback_key
from .swap import Around, Call, Swap, swap_for
from .unrouted import speak_up

Mode = Literal["auto", "redirect", "isolate"]
MODES: tuple[str, ...] = get_args(Mode)


def _as_gather(gather: nn.Module | Iterable[nn.Module]) -> tuple[nn.Module, ...]:
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


def _validate_inside(found: Detection, unwrapped: nn.Module, role: str) -> None:
    if not isinstance(unwrapped, nn.Module):
        raise RouteTypeError(
            f"{role} must be an nn.Module or None, got {type(unwrapped).__name__}; pass the model your loss "
            "reads (e.g. accelerator.unwrap_model(model)), or None to let wrapperroute find it"
        )
    if unwrapped is found.inner:
        return
    if any(each.module is unwrapped and isinstance(each.layer, Topology) for each in found.peeled):
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


class Plan:
    """What route_loss learns about one model object once: the wrapper to call, its adapter and the capabilities
    it has, the module whose forward is swapped, and the modules already checked to be inside the model.

    Every module is held weakly: a plan must never keep a model (its parameters, its GPU memory) alive. It is
    dropped with the model, and rebuilt when the model's class changes (fully_shard changes it), a wrapper it
    names is gone, or, for a model without a wrapper, the inner module's class changes. (A layer swapped for
    another while the old one lives on elsewhere is not noticed: route the new model object.)
    """

    __slots__ = (
        "adapter",
        "checked",
        "distributed",
        "entry_ref",
        "inner_ref",
        "inner_type",
        "isolating",
        "kind",
        "lasting",
        "model_ref",
        "model_type",
        "plain",
        "result_check",
        "surrounds",
        "swap",
        "target_ref",
        "units",
        "wrapper_ref",
    )  # fmt: skip

    def __init__(self, model: nn.Module) -> None:
        found = detect(model)  # first: it names a non-module argument clearly
        self.model_ref = weakref.ref(model)
        self.model_type = type(model)
        self.kind = found.kind
        self.inner_ref = weakref.ref(found.inner)
        self.inner_type = type(found.inner)
        wrapper: nn.Module | None = found.wrapper
        adapter = found.adapter if isinstance(found.adapter, Routing) else None
        self.lasting = True  # False: answered for this call only, not kept (see _unrouted.speak_up)
        if wrapper is None:
            self.lasting = speak_up(model, found)
        if adapter is None:
            # No wrapper to enter (or one whose forward arms nothing), but a layer whose forward must still run
            # (Fabric on one device): route through that layer alone.
            wrapper, adapter = found.entry, found.entry_adapter
        self.wrapper_ref: Callable[[], nn.Module | None] = _no_wrapper
        # What route_loss calls: the wrapper, or the layer entered around it (Fabric's module).
        self.entry_ref: Callable[[], nn.Module | None] = _no_wrapper
        self.adapter = adapter
        self.target_ref: Callable[[], nn.Module | None] = _no_wrapper
        self.swap: Swap | None = None
        # The capabilities the adapter has, read once: DDP's every step skips what it lacks.
        self.distributed = isinstance(adapter, Topology)
        self.surrounds = adapter if isinstance(adapter, AroundLoss) else None
        self.isolating = adapter if isinstance(adapter, Isolating) else None
        self.units = adapter if isinstance(adapter, ShardUnits) else None
        self.plain = False  # nothing to route through, and already spoken of: route_loss calls fn (see _new_plan)
        self.result_check: Callable[[nn.Module, Any], None] | None = None
        if wrapper is not None and adapter is not None:
            # nn.Module attribute lookups of submodules (``ddp.module``) cost a microsecond: once per model.
            target = adapter.redirect_target(wrapper)
            self.wrapper_ref, self.target_ref = weakref.ref(wrapper), weakref.ref(target)
            entry = found.entry if found.entry is not None and found.entry is not wrapper else None
            self.entry_ref = weakref.ref(entry) if entry is not None else self.wrapper_ref
            self.swap = swap_for(target)
            self.result_check = adapter.result_check(wrapper)
            adapter.prepare(wrapper)
        self.checked: dict[int, weakref.ref[nn.Module]] = {}

    def current(self, model: nn.Module) -> bool:
        """Still this model's plan: same object and class, and a wrapper it names alive (with none, the inner
        module's class unchanged: fully_shard after a first call through a torch.compile or PEFT layer)."""
        if self.model_ref() is not model or self.model_type is not type(model):
            return False
        if self.swap is not None:
            return self.wrapper_ref() is not None
        return type(self.inner_ref()) is self.inner_type

    def validate_inside(self, model: nn.Module, module: nn.Module, role: str) -> None:
        known = self.checked.get(id(module))
        if known is not None and known() is module:
            return
        _validate_inside(detect(model), module, role)
        self.checked[id(module)] = weakref.ref(module)


def _forget(key: int) -> None:
    state.plans.pop(key, None)


on_change(state.plans.clear)  # an adapter registered since may claim a layer of a planned model


def _new_plan(model: nn.Module) -> Plan:
    plan = Plan(model)
    if not plan.lasting:
        return plan
    key = id(model)
    if key not in state.plans:
        weakref.finalize(model, _forget, key)
    state.plans[key] = plan
    # route_loss's fast path for such a model: its plan, found by one lookup, says so. A class change
    # (fully_shard after a first call) misses the plan's class and plans again.
    plan.plain = plan.swap is None and type(model) in plain_types
    return plan


def resolve(
    model: nn.Module, unwrapped: nn.Module | None, fn: Callable[..., Any], args: tuple[Any, ...],
    kwargs: dict[str, Any], mode: str, gather: nn.Module | Iterable[nn.Module] | None,
) -> Call | None:  # fmt: skip
    """The routed call for these arguments, or None when ``fn`` is to be called plainly: no wrapper to route
    through, or this thread already inside its forward. Checks every argument (raising on a bad one) and
    repairs wrapper state a failed forward left behind. The plan found by one lookup decides the common step."""
    if not callable(fn):
        raise RouteTypeError(
            f"fn must be callable (the loss to run inside the wrapper), got {type(fn).__name__}; "
            "pass the function itself, not its result"
        )
    if mode != "auto" and mode not in MODES:
        raise RouteValueError(f"mode must be one of {MODES}, got {mode!r}")
    plan: Plan | None = state.plans.get(id(model))
    # The step's common case: a plan for this model (dropped with it) whose class and wrapper are unchanged.
    wrapper = plan.wrapper_ref() if plan is not None and plan.model_type is type(model) else None
    if wrapper is None or plan is None:  # a first call, a changed model, or a model with no distributed wrapper
        if (plan is not None and plan.plain and plan.model_type is type(model) and gather is None
                and (unwrapped is None or unwrapped is model)):  # fmt: skip
            return None  # a plain module already planned (and spoken of): nothing to route through
        if plan is None or not plan.current(model):
            plan = _new_plan(model)
        wrapper = plan.wrapper_ref()
    if unwrapped is not None and unwrapped is not plan.inner_ref():
        plan.validate_inside(model, unwrapped, "unwrapped")
    modules: tuple[nn.Module, ...] = ()
    if gather is not None:
        modules = _as_gather(gather)
        for module in modules:
            plan.validate_inside(model, module, "a gather= entry")
    adapter, swap = plan.adapter, plan.swap
    if wrapper is None or adapter is None or swap is None:
        return None
    if swap.count:  # calls of ours in flight on this target: is this thread's loss one of them?
        if id(wrapper) in state.thread.routing:
            return None  # already inside this wrapper's forward: armed for this step; entering again clobbers it
    elif adapter.marks_forward(wrapper):  # a forward runs: this thread's, another's, or one that raised
        if adapter.in_forward(wrapper):
            return None  # this thread is inside the wrapper's own forward (fn routed from it): armed already
        adapter.repair(wrapper)
    if plan.distributed and not dist.is_initialized():
        raise RouteStateError(
            f"model is a {plan.kind!r} wrapper but torch.distributed has no process group (never initialised, "
            "or destroyed): its forward cannot synchronise anything. Call torch.distributed.init_process_group "
            "before routing (and keep it until the last step), or route the unwrapped model without a wrapper."
        )
    if modules:
        adapter.validate_gather(wrapper, modules)
    nested = plan.units.nested_units(wrapper, modules) if plan.units is not None else ()
    isolated = state.isolated_losses
    isolate = mode == "isolate" or (mode == "auto" and bool(isolated) and fallback_key(fn) in isolated)
    around = (Around(plan.surrounds, plan.isolating if isolate else None, modules, nested)
              if plan.surrounds is not None or isolate or modules or nested else None)  # fmt: skip
    # the target and the entry are alive: the wrapper holds the target, and the entry is the model the caller holds
    # (or the wrapper itself)
    return Call(wrapper, plan.entry_ref(), plan.target_ref(), swap, adapter, fn, args, kwargs, around,  # type: ignore[arg-type]
                 plan.result_check, mode)  # fmt: skip
