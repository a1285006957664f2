"""Helpers shared by the rank bodies of several test modules (a library, not the bodies of any one test
module): a next-token fused loss and the cross-rank gradient measurement."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from wrapperroute.check.cell import differing_across_ranks


def shifted_fused_ce(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """Reads ``lm_head.weight`` directly: the pattern that skips the wrapper. Position t predicts ids[t + 1] and
    the last position is dropped, so this is not wrapperroute.check.losses.fused_cross_entropy (which scores
    every position against labels given whole)."""
    logits = model(ids) @ model.lm_head.weight.t()
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def measure(grads: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Every gradient compared across ranks (one all-gather): how many parameters differ, and by how much."""
    differ, worst = differing_across_ranks(grads)
    return {"params": len(grads), "differ": differ, "max_diff": worst}
