"""Exceptions raised by wrapperroute.

Every error is a :class:`WrapperRouteError`; each also subclasses the builtin a caller would naturally catch
(``TypeError`` for a wrong argument type, ``ValueError`` for a wrong value, ``RuntimeError`` for a state
problem), so ``except TypeError`` keeps working in code that predates this library.
"""

from __future__ import annotations

import os
import sys


class WrapperRouteError(Exception):
    """Base class of every error raised by wrapperroute."""


class RouteTypeError(WrapperRouteError, TypeError):
    """An argument has the wrong type (``fn`` not callable, ``model`` not an ``nn.Module``...)."""


class RouteValueError(WrapperRouteError, ValueError):
    """An argument has the right type but a wrong value (``unwrapped`` not inside ``model``, bad ``mode``...)."""


class RouteStateError(WrapperRouteError, RuntimeError):
    """The wrapper or process state does not allow routing now (process group missing, re-entry...)."""


class GradSyncError(WrapperRouteError, RuntimeError):
    """Gradients were produced while the distributed wrapper was not armed (raised by :func:`guard`)."""


class UnroutedModelWarning(UserWarning):
    """``route_loss`` found no distributed wrapper on a model with trainable parameters while several ranks run:
    nothing it can see synchronises that model's gradients. Filter it (``warnings.filterwarnings("ignore",
    category=UnroutedModelWarning)``) for a module whose gradients are synchronised some other way."""


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep  # wrapperroute/


def callers_level() -> int:
    """The ``stacklevel`` for :func:`warnings.warn` that points at the first frame outside wrapperroute, however the
    call came (``route_loss``, ``@routed``, ``token_divisor``, ``patch_trl``)."""
    level, frame = 1, sys._getframe(1)  # level 1: the function calling warnings.warn
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back
    return level
