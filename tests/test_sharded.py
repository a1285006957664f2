"""Sharded layouts proven: a gradient that reached an FSDP2 shard around the wrapper's reduction (a loss reading
the shard outside its unit's forward, as TRL's fused LM head does on a head in its own unit) is caught by
``check_grad_sync`` and ``guard``, and shown to be off one process on the global batch; every layout that reads
through the wrapper is exact and verified, with no false alarm; ``wrapperroute.losses`` refuses FSDP's shard; a
hand-rolled gather of a ZeRO-3 partition is loud, or right."""

from __future__ import annotations

import importlib.util

import pytest
import rankside_sharded

from wrapperroute.ranks import RankPool


@pytest.mark.parametrize(
    ("layout", "read", "routed"),
    [
        ("head_unit", "full_tensor", False),  # TRL's fused head: caught
        ("head_unit", "replicate", False),  # a redistribute to Replicate: caught
        ("head_keep", "full_tensor", False),  # the head unit kept unsharded after a forward that never ran: caught
        ("root", "full_tensor", False),  # the head in the root's group: exact, verified
        ("tail", "full_tensor", False),  # accelerate's grouped tail: exact, verified
        ("head_unit", "full_tensor", True),  # routed, the head gathered by its unit: exact, verified
    ],
)
def test_fsdp2_arrivals(pool: RankPool, layout: str, read: str, routed: bool) -> None:
    pool.run(rankside_sharded.arrivals, layout, read, routed)


def test_guard_warns_once_per_backward(pool: RankPool) -> None:
    pool.run(rankside_sharded.guard_warns_once)


def test_losses_refuse_the_fsdp_shard(pool: RankPool) -> None:
    pool.run(rankside_sharded.losses_refuse_the_fsdp_shard)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_zero3_hand_gather_is_loud_or_right(pool: RankPool) -> None:
    """Measured, not assumed: read outside the engine's forward a ZeRO-3 partition has 0 elements; gathered by
    hand and released before the backward, the backward fails; held through it, DeepSpeed's own hooks reduce the
    gradient, exactly. No silent route: nothing for the audit to watch."""
    for rank in pool.run(rankside_sharded.zero3_hand_gather, False):
        assert rank["outside"] == (0,) and rank["error"] is not None, rank
    for rank in pool.run(rankside_sharded.zero3_hand_gather, True):
        assert rank["error"] is None and rank["diff"] <= 1e-6, rank
