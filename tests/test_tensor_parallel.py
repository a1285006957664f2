"""Tensor-parallel heads on 4 CPU ranks: the vocabulary-parallel losses move nothing of the head's size, match
Liger's DPO and KTO on one process, take every option (tests/loss_reference.py's cases) exactly with hidden
states whole or sharded on tokens, refuse bad targets on every rank, and detect/route_loss see the layout.
Gradient truth of whole training steps on (dp x tp) meshes, by hand and by transformers, is `wrapperroute
check`'s: run here on its cells."""

from __future__ import annotations

import importlib.util
from typing import Any

import loss_reference as ref
import pytest
import rankside_loss_options as rlo
import rankside_tensor_parallel as rtp

from wrapperroute.check.cell import Cell, is_exact, run_cell
from wrapperroute.check.wrappers import WRAPPERS
from wrapperroute.ranks import RankPool


@pytest.mark.parametrize("tp", [2, 4])
def test_no_collective_moves_the_head(pool4: RankPool, tp: int) -> None:
    """Asserted in each rank, where the collectives are counted."""
    assert [rank["shard"] for rank in pool4.run(rtp.collective_sizes, tp)] == [rtp.VOCAB * rtp.HIDDEN // tp] * 4


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel is not installed")
@pytest.mark.parametrize("tp", [2, 4])
def test_dpo_and_kto_equal_ligers_on_one_process(pool4: RankPool, tp: int) -> None:
    """Asserted in each rank, where both losses and their gradients are computed."""
    assert all(set(rank) == {"dpo", "kto"} for rank in pool4.run(rtp.preference_against_liger, tp))


def test_detect_sees_the_layout_and_route_loss_stays_quiet(pool4: RankPool) -> None:
    ranks = pool4.run(rtp.layout_and_warnings, 2, True)
    assert [r["head_ranks"] for r in ranks] == [(0, 1), (0, 1), (2, 3), (2, 3)], ranks
    for rank in ranks:
        assert rank["kind"] == "fsdp2" and rank["dims"] == ("tp",), rank
        assert rank["sharded"] == {"lm_head.weight": "Shard(0) over tp"} and rank["head_vocab_sharded"], rank
        assert rank["warnings"] == [], rank
    for rank in pool4.run(rtp.layout_and_warnings, 4, False):  # tensor parallel over every rank: no replica
        assert rank["kind"] == "none" and rank["head_ranks"] == (0, 1, 2, 3) and rank["warnings"] == [], rank
        # every replicated parameter compared, none differing; the head's vocabulary slice has no copy on another
        # rank (each rank holds its own): not compared
        assert rank["sync"] == (rank["trainable"] - 1, 0), rank
    for rank in pool4.run(rtp.layout_and_warnings, 2, False):  # two copies of a tp=2 model, nothing syncing them
        assert rank["kind"] == "none" and rank["warnings"] == ["UnroutedModelWarning"], rank


LAYOUTS = ["tp2_dp2", "tp2_hsdp", "tp4", "hf_tp2_fsdp2", "hf_tp4"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_check_cells_exact(pool4: RankPool, layout: str) -> None:
    """Routed: 0 parameters differing across ranks, <= 1e-6 from one process on the global batch. Unrouted,
    where a data-parallel wrapper shards the head: the read outside its forward crashes."""
    reason = WRAPPERS[layout].unavailable(4)
    if reason is not None:
        pytest.skip(f"{layout} {reason}")
    for loss in ("vocab_ce", "vocab_dpo"):
        routed = pool4.run(run_cell, Cell(wrapper=layout, loss=loss, routed=True, steps=2))
        assert all(is_exact(rank) and rank.params > 0 for rank in routed), routed
        unrouted: list[dict[str, Any]] = pool4.run(run_cell, Cell(wrapper=layout, loss=loss, routed=False))
        if layout in ("tp2_dp2", "tp2_hsdp", "hf_tp2_fsdp2"):
            assert all(rank.error is not None for rank in unrouted), unrouted
        else:  # no data-parallel wrapper: nothing to route through, the same arithmetic
            assert all(is_exact(rank) for rank in unrouted), unrouted


@pytest.mark.parametrize("vocab", [6, 9])
def test_a_rank_without_vocabulary_rows(pool4: RankPool, vocab: int) -> None:
    """Asserted in each rank against torch on the whole head; the last rank holds no row of the vocabulary."""
    rows = [rank["rows"] for rank in pool4.run(rtp.uneven_vocabulary, vocab)]
    assert sum(rows) == vocab and rows[-1] == 0, rows


@pytest.mark.parametrize("tp", [2, 4])
def test_every_case_on_a_sharded_head(pool4: RankPool, tp: int) -> None:
    """Asserted in each rank against the truth on the whole head: hidden states whole, then sharded on tokens
    (sequence parallelism; per-token results back as DTensors sharded alike). Each case both ways, over the two
    head splits: every other case with whole hidden states on tp=2 and sharded ones on tp=4, the rest the other
    way round."""
    for sequence_parallel in (False, True):
        whole_first = (tp == 2) != sequence_parallel
        indices = [index for index in range(len(ref.CASES)) if (index % 2 == 0) == whole_first]
        worst = pool4.run(rlo.options_on_a_sharded_head, tp, sequence_parallel, [ref.CASES[i] for i in indices],
                         indices)  # fmt: skip
        assert all(rank["float64"] <= 1e-9 and rank["float32"] <= 1e-5 for rank in worst), worst
        print(f"tp={tp} sequence_parallel={sequence_parallel}: largest difference", {  # shown under pytest -s
            key: max(rank[key] for rank in worst) for key in ("float64", "float32")})  # fmt: skip


def test_bad_targets_raise_on_every_rank(pool: RankPool) -> None:
    """Two ranks, the head split between them: every rank raises (asserted in each), none hangs."""
    seen = pool.run(rlo.bad_targets_raise_on_every_rank)
    assert len(seen) == 2 and seen[0] == seen[1] and len(seen[0]) == 6, seen


def test_is_top1_across_shards(pool: RankPool) -> None:
    """Two words share the largest logit, one on each rank's slice: only the first is the top-1 word (argmax's,
    TRL's), on every rank."""
    assert pool.run(rlo.top1_across_shards) == [[True, False, False, False]] * 2
