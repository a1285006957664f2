"""check_grad_sync and guard on real ranks."""

from __future__ import annotations

import pytest
import rankside_diagnostics

from wrapperroute import RouteStateError, check_grad_sync
from wrapperroute.check.models import TinyConfig, build_model
from wrapperroute.ranks import RankPool


def test_check_grad_sync_ddp(pool: RankPool) -> None:
    for rank in pool.run(rankside_diagnostics.sync_reports, "ddp"):
        assert rank["unrouted"]["differing"] == rank["unrouted"]["compared"] > 0, rank
        assert "params differing" in rank["unrouted"]["table"]
        assert rank["routed"]["differing"] == 0 and rank["routed"]["compared"] > 0


@pytest.mark.parametrize("wrapper", ["fsdp1", "fsdp2"])
def test_check_grad_sync_sharded_says_what_it_compares(pool: RankPool, wrapper: str) -> None:
    for rank in pool.run(rankside_diagnostics.sync_reports, wrapper):
        assert rank["routed"]["compared"] == 0 and "not compared" in rank["routed"]["note"]


def test_check_grad_sync_needs_a_group() -> None:
    with pytest.raises(RouteStateError, match="init_process_group"):
        check_grad_sync(build_model(TinyConfig()))


def test_guard(pool: RankPool) -> None:
    for rank in pool.run(rankside_diagnostics.guard_verdicts):
        assert rank["normal"] == "ok"
        assert rank["routed"] == "ok"
        assert rank["no_sync_routed"] == "ok"
        assert rank["no_sync_unrouted"] == "ok"  # local on purpose inside no_sync
        assert rank["unrouted"].startswith("caught: gradients of a TinyCausalLM"), rank
        assert rank["routed_after"] == "ok"  # no stale state after a caught step
        assert rank["warn_unrouted"] == 1 and rank["warn_routed_after"] == 0, rank  # warned once per backward


def test_check_grad_sync_sees_an_adapter_added_after_fully_shard(pool: RankPool) -> None:
    """A plain trainable adapter beside an FSDP2-sharded frozen base is whole on every rank: compared there.
    Trained as written each rank's differs; averaged by hand they agree; sharded too, nothing is compared."""
    for rank in pool.run(rankside_diagnostics.adapter_after_fully_shard, "none"):
        assert rank["compared"] == 2 and rank["differing"] == 2, rank
    for rank in pool.run(rankside_diagnostics.adapter_after_fully_shard, "hand"):
        assert rank["compared"] == 2 and rank["differing"] == 0, rank
    for rank in pool.run(rankside_diagnostics.adapter_after_fully_shard, "shard"):
        assert rank["compared"] == 0 and "2 sharded" in rank["note"], rank
