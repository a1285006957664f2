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

import warnings

import torch
from torch import nn

from .._groups import world_size
from .._torch_internals import COMPOSABLE_REGISTRY_KEY
from ..adapters import registered
from ..detect import Detection, enclosing_wrapper, trains_alone
from ..errors import RouteValueError, UnroutedModelWarning, callers_level


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
    if not trains_alone(model, found):
        return True
    if not torch.is_grad_enabled():
        return False  # no gradient comes of this call (a teacher's no_grad forward); a later call is judged again
    if enclosing_wrapper(model) is not None:
        return False
    warnings.warn(
        f"wrapperroute: route_loss got a {type(model).__name__} with trainable parameters and no distributed "
        f"wrapper (layers seen: {' > '.join(found.chain)}) while torch.distributed runs "
        f"{world_size()} ranks: nothing wrapperroute can see synchronises its gradients, so every rank "
        "may be training its own copy. Pass the model your trainer holds (the DDP, FSDP or DeepSpeed wrapper, "
        "the Fabric module) as route_loss's first argument; a wrapper of your own, teach it with "
        "wrapperroute.register_adapter. If this module's gradients are synchronised some other way, silence "
        "this: warnings.filterwarnings('ignore', category=wrapperroute.UnroutedModelWarning).",
        UnroutedModelWarning,
        stacklevel=callers_level(),
    )
    return True


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
