"""Gradient truth through real FSDP1 and FSDP2 on 2 gloo ranks, nested shard units included."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import rankside_route_fsdp

from wrapperroute.check.cell import REFERENCE_TOLERANCE, Cell, run_cell
from wrapperroute.check.models import TinyConfig
from wrapperroute.ranks import RankPool

HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None

LAYOUTS = {
    "fsdp1-root": ("fsdp1", {}),
    "fsdp1-lm_head_unit": ("fsdp1", {"lm_head_unit": True}),
    "fsdp1-flat_params": ("fsdp1", {"use_orig_params": False}),
    "fsdp2-root": ("fsdp2", {}),
    "fsdp2-layers": ("fsdp2", {"groups": "layers"}),  # each block and lm_head their own group
}
LOSSES = [
    "fused_ce",
    pytest.param("liger_dpo", marks=pytest.mark.skipif(not HAS_LIGER, reason="liger-kernel is not installed")),
]


def _assert_exact(results: list[dict[str, Any]]) -> None:
    for rank in results:
        assert rank.error is None, rank.error
        assert rank.params > 0 and rank.differ == 0, rank
        assert rank.max_ref_diff <= REFERENCE_TOLERANCE, rank


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gradient_truth(pool: RankPool, layout: str, loss: str) -> None:
    wrapper, opts = LAYOUTS[layout]
    _assert_exact(pool.run(run_cell, Cell(wrapper=wrapper, loss=loss, wrapper_opts=opts, steps=2)))
    unrouted = pool.run(run_cell, Cell(wrapper=wrapper, loss=loss, wrapper_opts=opts, routed=False))
    for rank in unrouted:  # sharded parameters outside the forward: the loss cannot even run
        assert rank.error is not None, f"the unrouted path should fail here: {rank}"


@pytest.mark.parametrize("layout", ["fsdp1-lm_head_unit", "fsdp2-layers"])
def test_accumulation(pool: RankPool, layout: str) -> None:
    """FSDP1 no_sync() / FSDP2 set_requires_gradient_sync(False) for 2 micro-batches, then a sync step."""
    wrapper, opts = LAYOUTS[layout]
    _assert_exact(pool.run(run_cell, Cell(wrapper=wrapper, wrapper_opts=opts, accum=3, steps=2)))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resharded_after_step(pool: RankPool, layout: str) -> None:
    wrapper, opts = LAYOUTS[layout]
    pool.run(rankside_route_fsdp.shards_after_step, wrapper, opts)


@pytest.mark.parametrize("groups", ["root", "layers_tied"])
def test_fsdp2_tied_weights(pool: RankPool, groups: str) -> None:
    """lm_head tied to the embedding, in the root group or in one group with the embedding: exact."""
    config = TinyConfig(tied=True)
    _assert_exact(pool.run(run_cell, Cell(wrapper="fsdp2", wrapper_opts={"groups": groups}, config=config, steps=2)))


def test_fsdp2_tied_weights_split_groups_error_says_how(pool: RankPool) -> None:
    """Tied weights in two groups: FSDP2 itself refuses, naming the configuration that works (above)."""
    config = TinyConfig(tied=True)
    for rank in pool.run(run_cell, Cell(wrapper="fsdp2", wrapper_opts={"groups": "layers"}, config=config)):
        assert rank.error is not None and "fully_shard([module_a, module_b])" in rank.error, rank


def test_fsdp2_payload_not_cast(pool: RankPool) -> None:
    pool.run(rankside_route_fsdp.payload_not_cast)


@pytest.mark.parametrize("layout", ["fsdp1-lm_head_unit", "fsdp2-layers", "fsdp2-root"])
def test_reentrant_calls_are_plain(pool: RankPool, layout: str) -> None:
    wrapper, opts = LAYOUTS[layout]
    pool.run(rankside_route_fsdp.reentrant, wrapper, opts)
