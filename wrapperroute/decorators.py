"""``@routed``: run a whole ``compute_loss`` (or any loss function taking the model) inside the wrapper's forward.

A trainer's ``compute_loss(self, model, inputs, ...)`` receives the *wrapped* model. Code that unwraps it to
read ``lm_head.weight`` (fused losses) skips the wrapper's forward, so DDP never arms its reducer and FSDP or
ZeRO-3 never gather. Decorated, the body runs inside the wrapper's forward through :func:`route_loss` and sees
the *unwrapped* model as its model argument, so the same body is correct under every wrapper, and unchanged in
a single process.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any, TypeVar, overload

from torch import nn

from .detect import detect
from .errors import RouteTypeError, RouteValueError
from .route import MODES, Mode, route_loss

F = TypeVar("F", bound=Callable[..., Any])
Gather = Callable[[nn.Module], Iterable[nn.Module]]

_SELF_NAMES = ("self", "cls")


def _model_parameter(signature: inspect.Signature, model_arg: str | None, name: str) -> str:
    names = list(signature.parameters)
    if model_arg is not None:
        if model_arg not in names:
            raise RouteValueError(f"@routed(model_arg={model_arg!r}): {name} has no such parameter {names}")
        return model_arg
    if "model" in names:
        return "model"
    candidates = [n for n in names if n not in _SELF_NAMES]
    kind = signature.parameters[candidates[0]].kind if candidates else None
    if kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD, None):
        raise RouteValueError(
            f"@routed cannot tell which argument of {name} is the model; name it: @routed(model_arg='...')"
        )
    return candidates[0]


def _route(fn: Callable[..., Any], model_arg: str | None, mode: Mode, gather: Gather | None) -> Callable[..., Any]:
    name = getattr(fn, "__qualname__", repr(fn))
    signature = inspect.signature(fn)
    parameter = _model_parameter(signature, model_arg, name)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return fn(*args, **kwargs)  # let the function raise its own, familiar, TypeError
        model = bound.arguments.get(parameter)
        if not isinstance(model, nn.Module):
            return fn(*args, **kwargs)
        found = detect(model)
        if not found.distributed:
            return fn(*args, **kwargs)  # one process, or a plain module: nothing to route through
        bound.arguments[parameter] = found.inner
        modules = None if gather is None else list(gather(found.inner))
        # A partial, not (fn, *args): keeps arguments named ``mode``/``gather`` away from route_loss, and
        # route_loss keys its functorch fallback on ``fn`` itself through the partial.
        return route_loss(model, None, functools.partial(fn, *bound.args, **bound.kwargs), mode=mode, gather=modules)

    return wrapper


@overload
def routed(fn: F, /) -> F: ...


@overload
def routed(*, model_arg: str | None = None, mode: Mode = "auto", gather: Gather | None = None) -> Callable[[F], F]: ...


def routed(
    fn: Any = None,
    /,
    *,
    model_arg: str | None = None,
    mode: Mode = "auto",
    gather: Gather | None = None,
) -> Any:
    """Run the decorated loss inside its model argument's distributed-wrapper forward.

    Usable bare (``@routed``) or configured (``@routed(model_arg="student", gather=lambda m: [m.lm_head])``).

    The model argument is ``model_arg`` when given, else the parameter named ``model`` (the HF ``Trainer``'s
    ``compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None)``), else the first
    parameter other than ``self``/``cls``. When that argument is a distributed wrapper (DDP, FSDP1/2, a
    DeepSpeed engine, possibly under ``torch.compile``), the body is called inside the wrapper's forward with
    the innermost module in its place; otherwise the body is simply called.

    Args:
        model_arg: the name of the parameter holding the (wrapped) model.
        mode: passed to :func:`route_loss` (``"auto"``, ``"redirect"``, ``"isolate"``).
        gather: ``unwrapped -> modules`` whose parameters the body reads directly and that live in their own
            shard unit (FSDP) or partition (ZeRO-3), e.g. ``lambda m: [m.lm_head]``.

    Name, docstring and ``inspect.signature`` are the function's own. Works on plain functions, methods (bound
    or through the class), ``staticmethod`` and ``classmethod`` objects.
    """
    if mode not in MODES:
        raise RouteValueError(f"mode must be one of {MODES}, got {mode!r}")

    def decorate(target: Any) -> Any:
        if isinstance(target, (staticmethod, classmethod)):
            return type(target)(_route(target.__func__, model_arg, mode, gather))
        if not callable(target):
            raise RouteTypeError(f"@routed decorates a function or method, got {type(target).__name__}")
        return _route(target, model_arg, mode, gather)

    return decorate if fn is None else decorate(fn)


__all__ = ["routed"]
