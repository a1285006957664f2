"""wrapperroute: run a fused loss inside the distributed wrapper's forward, so gradients stay in sync.

Public surface::

    route_loss(model, unwrapped, fn, *args, **kwargs)   # run fn inside model's wrapper forward
    detect(model)                                        # which wrapper, which layers, which inner module
"""

from __future__ import annotations

from .detect import Detection, detect
from .errors import (
    GradSyncError,
    RouteStateError,
    RouteTypeError,
    RouteValueError,
    WrapperRouteError,
)
from .route import MODES, Mode, route_loss

__version__ = "0.1.0"

__all__ = [
    "MODES",
    "Detection",
    "GradSyncError",
    "Mode",
    "RouteStateError",
    "RouteTypeError",
    "RouteValueError",
    "WrapperRouteError",
    "__version__",
    "detect",
    "route_loss",
]
