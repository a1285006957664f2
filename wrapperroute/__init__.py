"""wrapperroute: run a fused loss inside the distributed wrapper's forward, so gradients stay in sync.

Public surface::

    route_loss(model, unwrapped, fn, *args, **kwargs)   # run fn inside model's wrapper forward
    @routed                                              # the same for a trainer's compute_loss
    detect(model)                                        # which wrapper, which layers, which inner module
    check_grad_sync(model)                               # after backward: are gradients equal across ranks?
    guard(model)                                         # raise when a DDP backward was never armed
    token_divisor(model, count)                          # divide a summed loss by it: the global token mean
    PipelineLoss(stages, summed)                         # a pipeline schedule's loss_fn on its last stage
    register_adapter(adapter)                            # teach it a wrapper of your own (wrapperroute.adapters)
"""

from __future__ import annotations

from ._tensor_parallel import TensorParallel
from .adapters import register_adapter
from .decorators import routed
from .detect import Detection, detect
from .diagnostics import SyncReport, check_grad_sync, guard
from .errors import (
    GradSyncError,
    RouteStateError,
    RouteTypeError,
    RouteValueError,
    UnroutedModelWarning,
    WrapperRouteError,
)
from .pipeline import PipelineLoss
from .route import MODES, Mode, route_loss
from .tokens import token_divisor

__version__ = "0.1.0"

__all__ = [
    "MODES",
    "Detection",
    "GradSyncError",
    "Mode",
    "PipelineLoss",
    "RouteStateError",
    "RouteTypeError",
    "RouteValueError",
    "SyncReport",
    "TensorParallel",
    "UnroutedModelWarning",
    "WrapperRouteError",
    "__version__",
    "check_grad_sync",
    "detect",
    "guard",
    "register_adapter",
    "route_loss",
    "routed",
    "token_divisor",
]
