"""Contexts that the forward we swap out would have entered, kept around the loss.

Some libraries wrap the inner module's ``forward`` in an instance attribute (accelerate's native AMP wraps it
in autocast and fp32 output conversion). Swapping that forward for the loss would silently drop them, so the
loss would run in a different precision than a normal forward of the same model.

accelerate's wrapper (``prepare`` with ``mixed_precision="bf16"``/``"fp16"``) is
``MethodType(convert_outputs_to_fp32(autocast(forward)))``: a function whose ``__wrapped__`` is a
``ConvertOutputsToFp32`` whose ``model_forward`` is ``torch.autocast``'s ``decorate_autocast``, which holds the
autocast instance in its closure. We walk that chain (no accelerate import needed) and re-enter an autocast
with the same settings. Output fp32 conversion is not kept: the loss's result is returned as ``fn`` made it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._torch_internals import autocast_settings

_MAX_DEPTH = 16


def _autocasts(forward: Any) -> list[torch.autocast]:
    found: list[torch.autocast] = []
    seen: set[int] = set()
    pending = [forward]
    while pending and len(seen) < _MAX_DEPTH:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current = getattr(current, "__func__", current)  # bound method -> function
        for cell in getattr(current, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # empty cell
                continue
            if isinstance(value, torch.autocast):
                found.append(value)
        # functools.wraps' __wrapped__, accelerate's ConvertOutputsToFp32.model_forward
        pending += [getattr(current, "__wrapped__", None), getattr(current, "model_forward", None)]
    return found


def kept_forward_context(
    target: nn.Module, original_forward: Callable[..., Any]
) -> Callable[[], contextlib.AbstractContextManager[Any]] | None:
    """A factory for the context the replaced ``forward`` entered around the real one, or None."""
    if "forward" not in target.__dict__:
        return None  # the class's own forward: nothing wrapped around it
    casts = _autocasts(original_forward)
    if not casts:
        return None
    # A fresh autocast per call: an instance keeps its previous state on itself, so sharing one across
    # threads or nested calls would restore the wrong state.
    settings = [autocast_settings(cast) for cast in casts]  # outermost first

    def context() -> contextlib.AbstractContextManager[Any]:
        stack = contextlib.ExitStack()
        for device, dtype, enabled, cache in settings:
            stack.enter_context(torch.autocast(device_type=device, dtype=dtype, enabled=enabled, cache_enabled=cache))
        return stack

    return context
