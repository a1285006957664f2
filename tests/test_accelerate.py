"""Models from ``Accelerator.prepare`` (DDP, DeepSpeed ZeRO-3) route exactly; native AMP's autocast is kept."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate", reason="accelerate is optional: pip install wrapperroute[accelerate]")

import rankside_accelerate

from wrapperroute.ranks import RankPool


def test_accelerate_ddp_exact(pool: RankPool) -> None:
    pool.run(rankside_accelerate.accelerate_gradient_truth, "ddp", ("ddp", "module"))


def test_accelerate_deepspeed_zero3_exact(pool: RankPool) -> None:
    pytest.importorskip("deepspeed", reason="DeepSpeed is optional: pip install wrapperroute[deepspeed]")
    pool.run(rankside_accelerate.accelerate_gradient_truth, "zero3", ("deepspeed", "module"))


def test_bf16_autocast_kept_inside_fn(pool: RankPool) -> None:
    """A normal forward of this model runs in autocast, so does our routed loss; a naive redirection drops it."""
    pool.run(rankside_accelerate.bf16_autocast_inside)


def test_accumulate_honours_no_sync(pool: RankPool) -> None:
    """First micro-batch: local gradients only; the boundary: synced."""
    pool.run(rankside_accelerate.accelerate_accumulate_no_sync)
