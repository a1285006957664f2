"""TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``, TRL >= 1.16: what its GRPO, RLOO, DPO, KTO and SFT
trainers install) on a tiny Llama under FSDP2, TRL's own code on real ranks. As installed, on a head in its own
unit: the head's gradient bypasses FSDP2's reduce-scatter, off one process on the global batch, and
``check_grad_sync`` names it. Under ``patch_trl()``: exact, every sharded gradient through the reduce-scatter. With
the head in the root's group TRL is right either way."""

from __future__ import annotations

from typing import Any

import pytest
import rankside_trl_fused_head

from wrapperroute.ranks import RankPool

utils = pytest.importorskip("trl.trainer.utils", reason="TRL is not installed")
if not hasattr(utils, "add_fused_lm_head"):
    pytest.skip("the installed TRL has no add_fused_lm_head (TRL >= 1.16 has)", allow_module_level=True)


@pytest.mark.parametrize(("layout", "family"), [("head_unit", "llama"), ("head_keep", "llama"), ("root", "llama"),
                                               ("head_unit", "mixtral")])  # fmt: skip
def test_fused_head(pool: RankPool, layout: str, family: str) -> None:
    for rank in pool.run(rankside_trl_fused_head.fused_head_step, layout, False, family):
        print(f"\nas installed, {layout}, {family}: {_said(rank)}")
        if layout == "root":
            assert not rank["bypassed"] and max(rank["diffs"].values()) <= 1e-6, rank
        else:
            assert rank["bypassed"] == ["lm_head.weight"] and rank["diffs"]["lm_head.weight"] > 1e-3, rank
    for rank in pool.run(rankside_trl_fused_head.fused_head_step, layout, True, family):
        print(f"patched, {layout}, {family}: {_said(rank)}")
        assert not rank["bypassed"] and rank["verified"] == len(rank["diffs"]), rank
        assert max(rank["diffs"].values()) <= 1e-6, rank


@pytest.mark.parametrize("layout", ["hsdp_head_unit", "hsdp_root"])
def test_fused_head_under_hsdp(pool4: RankPool, layout: str) -> None:
    """HSDP on 4 ranks (2 replicas of a 2-way shard): as installed, the head alone in its unit is bypassed and
    wrong; patched, every gradient within 1e-6 of one process on the global batch, each through FSDP2's
    reduction."""
    for patched in (False, True):
        for rank in pool4.run(rankside_trl_fused_head.fused_head_step, layout, patched):
            print(f"\n{'patched' if patched else 'as installed'}, {layout}: {_said(rank)}")
            if patched or layout == "hsdp_root":
                assert not rank["bypassed"] and max(rank["diffs"].values()) <= 1e-6, rank
            else:
                assert rank["bypassed"] == ["lm_head.weight"] and rank["diffs"]["lm_head.weight"] > 1e-3, rank


def test_guard(pool: RankPool) -> None:
    """guard raises from the backward of TRL's fused head as installed, on every rank; patched it is quiet."""
    for said in pool.run(rankside_trl_fused_head.guard_raises, False):
        assert said is not None and "lm_head.weight" in said and "reduce-scatter" in said, said
    assert pool.run(rankside_trl_fused_head.guard_raises, True) == [None, None]


def _said(rank: dict[str, Any]) -> str:
    worst = max(rank["diffs"], key=rank["diffs"].__getitem__)
    return f"bypassed {rank['bypassed']}, verified {rank['verified']}, worst {rank['diffs'][worst]:.3g} ({worst})"


@pytest.mark.parametrize("layout", ["tp_head_unit", "tp_root"])
def test_fused_head_on_a_vocabulary_sharded_head_under_fsdp2(pool4: RankPool, layout: str) -> None:
    """dp2 x tp2: the head split on the vocabulary over the tensor-parallel ranks, FSDP2 over the data-parallel
    ones, the head alone in its unit or in the root's group, every field TRL computes asked for. As installed,
    TRL gathers the whole head (``full_tensor()``), and the head alone in its unit gets a wrong gradient (0.197
    off); patched, nothing of the head's size is gathered (in a no-grad forward either, as a reference model's),
    and every gradient is within 1e-6 of one process on the global batch."""
    for rank in pool4.run(rankside_trl_fused_head.fused_head_tp_step, layout, False):
        print(f"\nas installed, {layout}: gathered {rank['gathered']}, worst {max(rank['diffs'].values()):.3g}")
        assert rank["gathered"], rank  # the premise: TRL's path gathers the head
        # alone in its unit, read outside that unit's forward: consistent and wrong; in the root's group: exact
        assert (rank["diffs"]["lm_head.weight"] > 1e-3) == (layout == "tp_head_unit"), rank
    for rank in pool4.run(rankside_trl_fused_head.fused_head_tp_step, layout, True):
        print(f"patched, {layout}: gathered {rank['gathered']}, worst {max(rank['diffs'].values()):.3g}")
        assert rank["gathered"] == [] and max(rank["diffs"].values()) <= 1e-6, rank
