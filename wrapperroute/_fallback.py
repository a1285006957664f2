"""The functorch fallback: a compiled ``torch.func`` loss that DDP's graph optimizer cannot split is run once
more isolated from that optimizer (``adapters/ddp.py``), and stays isolated for the process."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

# Code objects (or callable types) of losses that failed under DDP's graph optimizer: routed isolated from
# then on, so the failure and the retry happen once per process, not once per step.
_isolated_losses: set[object] = set()


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
