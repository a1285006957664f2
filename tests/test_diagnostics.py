"""check_grad_sync and guard on real ranks."""

from __future__ import annotations

import pytest
import rankside_diagnostics

from wrapperroute import RouteStateError, check_grad_sync
from wrapperroute.check.models import TinyConfig, build_model
from wrapperroute.ranks import RankPool


def test_check_grad_sync_ddp(pool: RankPool) -> None:
    pool.run(rankside_diagnostics.ddp_sync_reports)


@pytest.mark.parametrize("wrapper", ["fsdp1", "fsdp2"])
def test_check_grad_sync_sharded_says_what_it_compares(pool: RankPool, wrapper: str) -> None:
    pool.run(rankside_diagnostics.sharded_sync_report, wrapper)


def test_check_grad_sync_needs_a_group() -> None:
    with pytest.raises(RouteStateError, match="init_process_group"):
        check_grad_sync(build_model(TinyConfig()))


def test_guard(pool: RankPool) -> None:
    pool.run(rankside_diagnostics.guard_verdicts)


def test_check_grad_sync_sees_an_adapter_added_after_fully_shard(pool: RankPool) -> None:
    """A plain trainable adapter beside an FSDP2-sharded frozen base is whole on every rank: compared there.
    Trained as written each rank's differs; averaged by hand they agree; sharded too, nothing is compared."""
    pool.run(rankside_diagnostics.adapter_after_fully_shard, "none", 2, 2)
    pool.run(rankside_diagnostics.adapter_after_fully_shard, "hand", 2, 0)
    pool.run(rankside_diagnostics.adapter_after_fully_shard, "shard", 0, None, "2 sharded")
