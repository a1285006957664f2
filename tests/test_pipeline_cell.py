"""The pipeline cells of ``wrapperroute check``: the schedules on 2 ranks, data and tensor parallelism inside the
stages on 4, each as the default matrix picks them; routed exact, the bare loss shown crashing where it does, the
schedule's own scaling of a per-micro-batch mean shown off."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from wrapperroute.check.pipeline_cell import PIPELINES, PipelineCell, run_pipeline_cell
from wrapperroute.cli import DEFAULT_WRAPPERS, LAYOUTS, _names
from wrapperroute.ranks import RankPool


def test_the_default_matrix_picks_them_by_ranks() -> None:
    two = _names(None, LAYOUTS, DEFAULT_WRAPPERS, "wrapper", 2)
    four = _names(None, LAYOUTS, DEFAULT_WRAPPERS, "wrapper", 4)
    assert {"pp2_gpipe", "pp2_1f1b", "pp2_interleaved", "pp2_zbv"} <= set(two), two
    assert {"pp2_dp2_fsdp2", "pp2_dp2_ddp", "pp2_tp2"} <= set(four), four
    assert not {"pp2_dp2_fsdp2", "pp2_dp2_ddp", "pp2_tp2"} & set(two) and "pp2_gpipe" not in four


def test_check_on_two_ranks() -> None:
    """Every schedule routed exact; the bare loss on plain stages exact too (no wrapper to miss); the schedule's
    scaling of each micro-batch's own mean off one process."""
    done = subprocess.run(
        [sys.executable, "-m", "wrapperroute", "check", "--wrappers", "pp2_gpipe,pp2_1f1b,pp2_interleaved,pp2_zbv",
         "--losses", "fused_ce", "--steps", "2", "--json"],
        capture_output=True, text=True, timeout=300, env=os.environ,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    cells = {(c["wrapper"], c["routed"]): c for c in json.loads(done.stdout)["cells"]}
    for name in ("pp2_gpipe", "pp2_1f1b", "pp2_interleaved", "pp2_zbv"):
        assert cells[(name, True)]["verdict"] == "exact" and cells[(name, True)]["max_ref_diff"] <= 1e-6, cells
        assert cells[(name, False)]["verdict"] == "in sync", cells[(name, False)]
    scaled = cells[("pp2_gpipe", "scaled")]
    assert scaled["verdict"] == "off: what PipelineLoss fixes" and scaled["max_ref_diff"] > 1e-3, scaled


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
