"""``fully_shard`` (FSDP2): no wrapper object. The module's class becomes ``FSDP<Cls>`` and FSDP's logic runs
in forward hooks, so the root *is* the model: we swap the root's own forward and call it.

Two consequences handled here:
- a loss that calls the root model again (natural: with FSDP2, the "unwrapped" model is the root) would run
  FSDP's hooks a second time and reshard mid-loss; while the loss runs the unit's hooks are set aside, so such
  a call is a plain forward over parameters that are already unsharded;
- groups nested below the root (``fully_shard(lm_head)``) unshard only in their own forward: loss reads of
  their weights are routed through them too (see ``_units.py``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

from torch import nn

try:  # exported here since torch 2.6
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # torch 2.4-2.5
    from torch.distributed._composable.fsdp import FSDPModule  # type: ignore[no-redef,unused-ignore]

from ._units import units_for
from .base import Adapter

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs")
_auto_units: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref[nn.Module], ...]] = weakref.WeakKeyDictionary()


# Hook dicts set aside while a loss runs, until put back (by the loss's exit, or by recover() after a fault).
_set_aside: weakref.WeakKeyDictionary[nn.Module, dict[str, Any]] = weakref.WeakKeyDictionary()


def _put_hooks_back(unit: nn.Module, saved: dict[str, Any] | None = None) -> None:
    """Put back the unit's hooks still set aside (``saved``: only those; a generator closed late must not put
    back over a later step's)."""
    aside = _set_aside.get(unit)
    if aside is None or (saved is not None and aside is not saved):
        return
    unit.__dict__.update(aside)
    del _set_aside[unit]  # last: until the hooks are back, recover() must still find them


def _is_unit(module: nn.Module) -> bool:
    return isinstance(module, FSDPModule)


class FSDP2Adapter(Adapter):
    kind = "fsdp2"
    distributed = True

    def claims(self, module: nn.Module) -> bool:
        return isinstance(module, FSDPModule)

    def peel(self, module: nn.Module) -> nn.Module:
        return module

    def in_forward(self, wrapper: nn.Module) -> bool:
        state = wrapper._get_fsdp_state()  # type: ignore[operator]
        return getattr(state, "_training_state", None) is not None and state._training_state.name == "FORWARD"

    def describe(self, wrapper: nn.Module) -> dict[str, Any]:
        return {"nested_groups": sum(1 for m in wrapper.modules() if _is_unit(m)) - 1}

    def recover(self, wrapper: nn.Module) -> None:
        for unit in wrapper.modules():  # the root, or a nested group whose forward the loss was routed through
            _put_hooks_back(unit)
        # FSDP2's documented recovery after a forward that raised (torch >= 2.13): reshard every group and
        # clear the iteration's trackers; otherwise the root stays in FORWARD with iter_forward_root set.
        reset = getattr(wrapper, "reset_iter_state", None)
        if reset is not None:
            reset()
            return
        state = wrapper._get_fsdp_state()  # type: ignore[operator]
        ctx = state._state_ctx
        for each in ctx.all_states:  # older torch: the same by hand, without collectives
            for group in each._fsdp_param_groups if hasattr(each, "_fsdp_param_groups") else [each._fsdp_param_group]:
                if group is not None:
                    group._training_state = type(group._training_state).IDLE
                    group._post_forward_indices.clear()
                    group.reshard()
            each._training_state = type(each._training_state).IDLE
        # The backward prefetches groups in the recorded post-forward order, cleared only by a completed
        # backward: a rank whose failed forward recorded a different order would prefetch other groups than
        # its peers in the next backward and deadlock (torch 2.9.1, one rank failing under agree=True).
        state._comm_ctx.post_forward_order.clear()
        ctx.iter_forward_root = None
        ctx.post_backward_final_callback_queued = False

    def nested_units(self, wrapper: nn.Module, gather: tuple[nn.Module, ...]) -> tuple[nn.Module, ...]:
        return units_for(wrapper, wrapper, gather, _is_unit, _auto_units)

    @contextlib.contextmanager
    def inside(self, wrapper: nn.Module, *, isolate: bool, gather: tuple[nn.Module, ...]) -> Iterator[None]:
        # Set FSDP's hooks aside (not cleared in place: the dicts are FSDP's own objects). All four in one
        # dict update each way, and recorded for recover(): a Ctrl-C landing between two Python calls (even in
        # contextlib's own frames, leaving this generator suspended) must not leave the unit without hooks.
        attributes = wrapper.__dict__
        saved = {name: attributes[name] for name in _HOOK_DICTS}
        _set_aside[wrapper] = saved
        try:
            attributes.update({name: type(hooks)() for name, hooks in saved.items()})
            yield
        finally:
            _put_hooks_back(wrapper, saved)
