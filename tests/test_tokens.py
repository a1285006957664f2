"""``token_divisor``: a summed loss over it is exactly the mean over every valid token of the global batch, with a
different number of valid tokens on every rank and micro-batch, under each wrapper; each rank's own mean on the
same batches is not (the objective the divisor replaces). Bad counts fail on every rank; the divisor follows
what the wrapper really divides by; transformers' ``Trainer`` through ``trainer_token_divisor``."""

from __future__ import annotations

import importlib.util
import math

import pytest
import rankside_tokens
import torch
from torch import nn

from wrapperroute import RouteValueError, token_divisor
from wrapperroute.check.cell import REFERENCE_TOLERANCE, Cell, CellResult, run_cell
from wrapperroute.check.wrappers import WRAPPERS
from wrapperroute.ranks import RankPool

# the per-rank mean's error on these batches is ~0.1; anything above this is a different objective, not rounding
DIFFERENT_OBJECTIVE = 1e-3


def _worst(results: list[CellResult]) -> CellResult:
    for rank in results:
        assert rank.error is None, rank.error
        assert rank.params > 0 and rank.differ == 0, rank
    return max(results, key=lambda r: r.max_ref_diff)


@pytest.mark.parametrize("wrapper", ["ddp", "replicate", "fsdp1", "fsdp2", "fabric_ddp", "zero2", "zero3"])
def test_global_token_mean_under_each_wrapper(pool: RankPool, wrapper: str) -> None:
    reason = WRAPPERS[wrapper].unavailable()
    if reason is not None:
        pytest.skip(reason)
    loss = "vocab_ce" if wrapper in ("fsdp2", "zero3") else "fused_ce"
    divided = _worst(pool.run(run_cell, Cell(wrapper, loss, accum=2, steps=2)))
    assert divided.max_ref_diff <= REFERENCE_TOLERANCE, divided
    own_mean = _worst(pool.run(run_cell, Cell(wrapper, loss, accum=2, normalise="rank_mean")))
    assert own_mean.max_ref_diff > DIFFERENT_OBJECTIVE, own_mean  # the same batches, each rank's own mean


def test_bad_counts_fail_on_every_rank(pool: RankPool) -> None:
    pool.run(rankside_tokens.bad_counts)


def test_inside_a_routed_loss_the_wrapper_is_found(pool: RankPool) -> None:
    pool.run(rankside_tokens.inside_a_routed_loss)


def test_without_a_wrapper_the_local_count_is_said(pool: RankPool) -> None:
    pool.run(rankside_tokens.without_a_wrapper)


def test_a_communication_hook_of_the_users_own_is_said(pool: RankPool) -> None:
    pool.run(rankside_tokens.unread_hook)


def test_fsdp2_divide_factor_is_read(pool: RankPool) -> None:
    reason = WRAPPERS["fsdp2"].unavailable()
    if reason is not None:
        pytest.skip(reason)
    pool.run(rankside_tokens.fsdp2_divide_factor)


def test_one_process() -> None:
    """No process group: the count itself; bad ones raise before anything else."""
    model = nn.Linear(2, 2)
    value = float(token_divisor(model, 12))
    assert value == 12.0, f"the divisor of 12 tokens in one process: {value}"
    value = float(token_divisor(model, torch.tensor(5, dtype=torch.int32)))
    assert value == 5.0, f"the divisor of an int32 tensor of 5: {value}"
    dtype = token_divisor(model, 3).dtype
    assert dtype == torch.get_default_dtype(), f"the divisor's dtype {dtype}, not the default"
    for bad in (-1, 0.5, math.inf, "3", torch.zeros(3), 0):
        with pytest.raises(RouteValueError):
            token_divisor(model, bad)  # type: ignore[arg-type]


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")
@pytest.mark.parametrize("layout", ["ddp", "zero3"])
def test_trainer_compute_loss(pool: RankPool, layout: str) -> None:
    """A routed ``compute_loss`` of a ``Trainer`` with 2 micro-batches of uneven counts per rank: exact over
    ``trainer_token_divisor``; over ``num_items_in_batch`` alone (the Trainer's own compute_loss multiplies by the
    processes, an override does not) the gradient is half the mean's."""
    if layout == "zero3" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs deepspeed")
    pool.run(rankside_tokens.trainer_token_mean, layout, "divisor")
    pool.run(rankside_tokens.trainer_token_mean, layout, "num_items", DIFFERENT_OBJECTIVE)
