"""A capability of sharded wrappers: a frozen model's weights that a loss reads directly, held whole outside the
wrapper's forward (TRL's reference and teacher models, read under no gradient). A wrapper without it holds every
parameter whole already."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any

from torch import nn


class ReadWhole(ABC):
    """A sharded wrapper that can make a frozen model's directly-read weights whole outside its forward."""

    @abstractmethod
    def read_whole(self, wrapper: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Context entered *outside* the wrapper's forward in which the weights a loss reads directly (the root's
        own parameters, the output embedding) are whole. Nothing is reduced."""
