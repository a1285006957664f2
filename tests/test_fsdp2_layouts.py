"""Layouts that need 4 ranks to be what they are, on a 4-rank gloo pool: FSDP2 HSDP (a 2x2 mesh, replicate x
shard), the grouped tail unit accelerate's FSDP2 plugin builds, ``reshard_after_forward=False`` and an int
(resharding to 2 of 4 ranks), FSDP1's hybrid sharding and context parallelism over a flattened mesh. Routed:
exact against one process on the global batch; unrouted: the loss that reads the backbone's sharded weights
outside any forward crashes.
"""

from __future__ import annotations

from typing import Any

import pytest
import rankside_fsdp2_layouts

from wrapperroute.check.cell import REFERENCE_TOLERANCE, Cell, run_cell
from wrapperroute.check.wrappers import WRAPPERS
from wrapperroute.ranks import RankPool

LAYOUTS = ["hsdp", "fsdp2_tail", "fsdp2_keep", "fsdp2_reshard2"]


def _assert_exact(results: list[dict[str, Any]]) -> None:
    assert len(results) == 4, f"{len(results)} ranks answered, not 4"
    for rank in results:
        assert rank.error is None, rank.error
        assert rank.params > 0 and rank.differ == 0, rank
        assert rank.max_ref_diff <= REFERENCE_TOLERANCE, rank
    assert len({tuple(rank.losses) for rank in results}) == 4, "ranks must see different data"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradient_truth(pool4: RankPool, layout: str) -> None:
    reason = WRAPPERS[layout].unavailable()
    if reason is not None:
        pytest.skip(reason)
    for loss in ("fused_ce", "backbone_ce"):
        _assert_exact(pool4.run(run_cell, Cell(layout, loss, steps=2)))
    for rank in pool4.run(run_cell, Cell(layout, "backbone_ce", routed=False)):
        assert rank.error is not None and "DTensor" in rank.error, rank


def test_hsdp_accumulation(pool4: RankPool) -> None:
    """Two micro-batches with gradient sync off, then a sync step, across both mesh dimensions."""
    _assert_exact(pool4.run(run_cell, Cell("hsdp", "fused_ce", accum=3, steps=2)))


def test_tail_group_hides_the_bug_for_a_root_loss(pool4: RankPool) -> None:
    """Measured: in the tail layout the group holding lm_head stays unsharded after the root's forward
    (reshard_after_forward=False), so a loss that calls the root and then reads lm_head.weight happens to be
    exact even unrouted; a loss reading the backbone directly still crashes (above). Routing is exact in both."""
    for rank in pool4.run(run_cell, Cell("fsdp2_tail", "fused_ce", routed=False)):
        assert rank.error is None and rank.differ == 0 and rank.max_ref_diff <= REFERENCE_TOLERANCE, rank


def test_agree_runs_among_the_ranks_of_the_wrappers_mesh(pool4: RankPool) -> None:
    """agree=True exchanges its flag among the ranks that run the wrapper's step (its mesh), not the world: a
    failure on rank 1 stops ranks 0-1, and the model on ranks 2-3 steps on."""
    pool4.run(rankside_fsdp2_layouts.agree_on_sub_meshes, timeout=120)


@pytest.mark.parametrize("layout", ["fsdp1_hybrid", "dp2_cp2"])
def test_global_token_mean_over_two_dimensions(pool4: RankPool, layout: str) -> None:
    """Gradients averaged over two groups (FSDP1's hybrid sharding), or each sequence cut over context-parallel
    ranks (FSDP2 over the flattened mesh): ``token_divisor`` counts every rank that trains on different tokens,
    and the summed loss over it is exact against one process's token mean; each rank's own mean is not."""
    reason = WRAPPERS[layout].unavailable()
    if reason is not None:
        pytest.skip(reason)
    _assert_exact(pool4.run(run_cell, Cell(layout, "backbone_ce", accum=2, steps=2)))
    for rank in pool4.run(run_cell, Cell(layout, "backbone_ce", accum=2, normalise="rank_mean")):
        assert rank.error is None and rank.max_ref_diff > 1e-3, rank  # the same batches, each rank's own mean


def test_experts_over_an_ep_dimension(pool4: RankPool) -> None:
    pool4.run(rankside_fsdp2_layouts.experts_over_ep)


def test_averaging_over_nested_meshes(pool4: RankPool) -> None:
    import rankside_averaging

    pool4.run(rankside_averaging.nested_meshes)
