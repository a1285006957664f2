"""What ``route_loss`` says about a model it finds no distributed wrapper on: never a silent pass-through.

- A module carrying torch composable distributed state that no adapter knows is an error: its forward hooks
  would do something wrapperroute cannot reproduce around the loss.
- Several ranks, trainable parameters, and no wrapper: an :class:`~wrapperroute.UnroutedModelWarning`, once per
  model (each rank may be training its own copy).
- Quiet: a single process; a module with no trainable parameter (a frozen reference model); a call under
  ``torch.no_grad()`` (a distillation teacher's forward: no gradient comes of it); a tensor-parallel model whose
  mesh spans every rank (its ranks hold slices of one model, not replicas); a call made inside
  the forward of a distributed wrapper that contains the module (a Lightning ``training_step`` runs inside the
  strategy's wrapper, so the wrapper is armed already and the loss is simply called).
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from .._torch_internals import COMPOSABLE_REGISTRY_KEY
from ..adapters import modules_being_called, registered
from ..errors import RouteValueError, UnroutedModelWarning

if TYPE_CHECKING:
    from ..detect import Detection


def enclosing_wrapper(model: nn.Module) -> nn.Module | None:
    """The distributed wrapper whose forward this thread is running and that contains ``model``, or None."""
    distributed = [adapter for adapter in registered() if adapter.distributed]
    for module in modules_being_called(sys._getframe(1)):
        if (
            module is not model
            and any(adapter.claims(module) for adapter in distributed)
            and any(sub is model for sub in module.modules())
        ):
            return module
    return None


def speak_up(model: nn.Module, found: Detection) -> bool:
    """Raise or warn, as above, for a model with no distributed wrapper. Returns whether the answer holds for
    later calls too (False inside an enclosing wrapper's forward: the next call may come from outside it)."""
    unknown = unrouted_state(found.inner)
    if unknown:
        raise RouteValueError(
            f"{type(model).__name__} carries torch composable distributed state that wrapperroute does not know "
            f"how to route: {'; '.join(unknown)}. Its forward hooks would not run around the loss. Route the "
            "wrapper that owns these modules, compute the loss through model(...), or report this API."
        )
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return True
    if not any(p.requires_grad for p in model.parameters()):
        return True
    if not torch.is_grad_enabled():
        return False  # no gradient comes of this call (a teacher's no_grad forward); a later call is judged again
    layout = found.tensor_parallel
    if layout is not None and set(layout.mesh_ranks) >= set(range(dist.get_world_size())):
        return True  # tensor parallelism over every rank: each holds its own slices of one model, not a replica
    if enclosing_wrapper(model) is not None:
        return False
    warnings.warn(
        f"wrapperroute: route_loss got a {type(model).__name__} with trainable parameters and no distributed "
        f"wrapper (layers seen: {' > '.join(found.chain)}) while torch.distributed runs "
        f"{dist.get_world_size()} ranks: nothing wrapperroute can see synchronises its gradients, so every rank "
        "may be training its own copy. Pass the model your trainer holds (the DDP, FSDP or DeepSpeed wrapper, "
        "the Fabric module) as route_loss's first argument. If this module's gradients are synchronised some "
        "other way, silence this: warnings.filterwarnings('ignore', category=wrapperroute.UnroutedModelWarning).",
        UnroutedModelWarning,
        stacklevel=_callers_level(),
    )
    return True


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # wrapperroute/


def _callers_level() -> int:
    """The ``stacklevel`` of the first frame outside wrapperroute, however the call came (``route_loss``,
    ``@routed``, ``patch_trl``): where the warning points."""
    level, frame = 1, sys._getframe(1)  # level 1: the function calling warnings.warn
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back
    return level


def unrouted_state(module: nn.Module) -> list[str]:
    """Modules below ``module`` (itself included) carrying torch composable distributed state that no adapter
    claims, as ``"path (Class): api, ..."``. Activation checkpointing (``checkpoint``) is not distributed."""
    adapters = registered()
    found: list[str] = []
    for name, sub in module.named_modules():
        apis = [api for api in getattr(sub, COMPOSABLE_REGISTRY_KEY, None) or () if api != "checkpoint"]
        if apis and not any(adapter.claims(sub) for adapter in adapters):
            found.append(f"{name or '<root>'} ({type(sub).__name__}): {', '.join(apis)}")
    return found
