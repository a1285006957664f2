"""The pipeline cells of ``wrapperroute check``: the schedules on 2 ranks, data and tensor parallelism inside the
stages on 4, each as the default matrix picks them; routed exact, the bare loss shown crashing where it does, the
schedule's own scaling of a per-micro-batch mean shown off. (The CLI's table and JSON with a pipeline cell:
tests/test_cli.py; every schedule on 2 ranks: tests/test_pipeline.py.)"""

from __future__ import annotations

from wrapperroute.check.pipeline_cell import PIPELINES, PipelineCell, run_pipeline_cell
from wrapperroute.cli import DEFAULT_WRAPPERS, LAYOUTS, _names
from wrapperroute.ranks import RankPool


def test_the_default_matrix_picks_them_by_ranks() -> None:
    two = _names(None, LAYOUTS, DEFAULT_WRAPPERS, "wrapper", 2)
    four = _names(None, LAYOUTS, DEFAULT_WRAPPERS, "wrapper", 4)
    assert {"pp2_gpipe", "pp2_1f1b", "pp2_interleaved", "pp2_zbv"} <= set(two), two
    assert {"pp2_dp2_fsdp2", "pp2_dp2_ddp", "pp2_tp2"} <= set(four), four
    assert not {"pp2_dp2_fsdp2", "pp2_dp2_ddp", "pp2_tp2"} & set(two) and "pp2_gpipe" not in four


def test_cells_on_four_ranks(pool4: RankPool) -> None:
    """FSDP2 inside the stages (the head its own unit): the bare loss crashes on the last stage and every rank says
    so (none left waiting); routed exact on every 4-rank layout; each micro-batch's own mean scaled off."""
    bare = pool4.run(run_pipeline_cell, PipelineCell(PIPELINES["pp2_dp2_fsdp2"], "bare"))
    assert all(rank.error and "mixed torch.Tensor and DTensor" in rank.error for rank in bare), bare
    for name in ("pp2_dp2_fsdp2", "pp2_dp2_ddp", "pp2_tp2"):
        for rank in pool4.run(run_pipeline_cell, PipelineCell(PIPELINES[name], "routed", steps=2)):
            assert rank.error is None and rank.differ == 0 and rank.max_ref_diff <= 1e-6, (name, rank)
            assert rank.params > 0 and not rank.bypassed, (name, rank)
    scaled = pool4.run(run_pipeline_cell, PipelineCell(PIPELINES["pp2_dp2_ddp"], "scaled"))
    assert max(rank.max_ref_diff for rank in scaled) > 1e-3, scaled
