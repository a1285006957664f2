"""Models from ``Accelerator.prepare`` (DDP, DeepSpeed ZeRO-3) route exactly; native AMP's autocast is kept."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate", reason="accelerate is optional: pip install wrapperroute[accelerate]")

import rankside_accelerate

from wrapperroute.check.cell import REFERENCE_TOLERANCE
from wrapperroute.ranks import RankPool


def test_accelerate_ddp_exact(pool: RankPool) -> None:
    results = pool.run(rankside_accelerate.accelerate_gradient_truth, "ddp")
    print(results[0])
    assert results[0]["chain"] == ("ddp", "module")
    for result in results:
        assert result["params"] == 6 and result["differ"] == 0 and result["max_ref_diff"] <= REFERENCE_TOLERANCE, result


def test_accelerate_deepspeed_zero3_exact(pool: RankPool) -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed is optional: pip install wrapperroute[deepspeed]")
    results = pool.run(rankside_accelerate.accelerate_gradient_truth, "zero3")
    print(results[0])
    assert results[0]["chain"] == ("deepspeed", "module")
    for result in results:
        assert result["params"] == 6 and result["differ"] == 0 and result["max_ref_diff"] <= REFERENCE_TOLERANCE, result


def test_bf16_autocast_kept_inside_fn(pool: RankPool) -> None:
    seen = pool.run(rankside_accelerate.accelerate_autocast_inside, "bf16")[0]
    print(seen)
    assert seen["normal"] == (True, "torch.bfloat16")  # a normal forward of this model runs in autocast
    assert seen["routed"] == (True, "torch.bfloat16")  # so does our routed loss
    assert seen["naive"] == (False, "torch.float32")  # a naive redirection drops it
    assert seen["after"] is False and seen["forward_restored"]


def test_accumulate_honours_no_sync(pool: RankPool) -> None:
    result = pool.run(rankside_accelerate.accelerate_accumulate_no_sync)[0]
    print(result)
    assert result["differ_per_micro"][0] > 0  # first micro-batch: local gradients only
    assert result["differ_per_micro"][1] == 0  # boundary: synced
