"""The output embedding: the module a fused loss reads directly by convention (its weight, never its forward)."""

from __future__ import annotations

from torch import nn


def output_embedding(model: nn.Module) -> nn.Module | None:
    """The module a fused loss reads by convention: HF's output embeddings, else ``lm_head``."""
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        try:
            found = getter()
        except (AttributeError, NotImplementedError):
            found = None
        if isinstance(found, nn.Module):
            return found
    head = getattr(model, "lm_head", None)
    return head if isinstance(head, nn.Module) else None
