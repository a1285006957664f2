"""Contexts that the forward we swap out would have entered, kept around the loss.

Some libraries wrap the inner module's ``forward`` in an instance attribute (accelerate's native AMP wraps it
in autocast and fp32 output conversion). Swapping that forward for the loss would silently drop them, so the
loss would run in a different precision than a normal forward of the same model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torch import nn


def kept_forward_context(
    target: nn.Module, original_forward: Callable[..., Any]
) -> Callable[[], contextlib.AbstractContextManager[Any]] | None:
    """A factory for the context the replaced ``forward`` entered around the real one, or None."""
    return None
