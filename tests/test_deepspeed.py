"""DeepSpeed ZeRO 0-3 on 2 gloo CPU ranks: gradient truth with route_loss, and what goes wrong without it."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is optional: pip install wrapperroute[deepspeed]")

import rankside_deepspeed

from wrapperroute.check.cell import REFERENCE_TOLERANCE, Cell, run_cell
from wrapperroute.ranks import RankFailure, RankPool

NO_PERSIST = {"stage3_param_persistence_threshold": 0}


def _run(pool: RankPool, cell: Cell) -> dict[str, Any]:
    start = time.perf_counter()
    results = pool.run(run_cell, cell)
    for result in results:
        assert result.error is None, result.error
    print(f"{cell.label()}: {results[0]} ({time.perf_counter() - start:.1f}s)")
    return results[0]


def _assert_exact(result: dict[str, Any]) -> None:
    assert result.params > 0, f"no gradient compared: {result}"
    assert result.differ == 0, result
    assert result.max_ref_diff <= REFERENCE_TOLERANCE, result


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_fused_ce_exact(pool: RankPool, stage: int) -> None:
    _assert_exact(_run(pool, Cell(wrapper=f"zero{stage}", loss="fused_ce", steps=2)))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_liger_dpo_exact(pool: RankPool, stage: int) -> None:
    pytest.importorskip("liger_kernel", reason="the Liger DPO loss needs liger-kernel")
    _assert_exact(_run(pool, Cell(wrapper=f"zero{stage}", loss="liger_dpo")))


@pytest.mark.parametrize("loss", ["fused_ce", "liger_dpo"])
def test_zero3_unrouted_fails_routed_exact(pool: RankPool, loss: str) -> None:
    if loss == "liger_dpo":
        pytest.importorskip("liger_kernel", reason="the Liger DPO loss needs liger-kernel")
    results = pool.run(run_cell, Cell(wrapper="zero3", loss=loss, routed=False))
    # Outside the engine's forward the partitioned head is an empty shard.
    assert all(r.error and "size mismatch" in r.error for r in results), results
    _assert_exact(_run(pool, Cell(wrapper="zero3", loss=loss, wrapper_opts={"zero": NO_PERSIST})))


def test_zero3_no_persistence_exact(pool: RankPool) -> None:
    _assert_exact(_run(pool, Cell(wrapper="zero3", loss="fused_ce", steps=2, wrapper_opts={"zero": NO_PERSIST})))


@pytest.mark.parametrize("backward", ["engine", "torch"])
@pytest.mark.parametrize("stage", [2, 3])
def test_gradient_accumulation_exact(pool: RankPool, stage: int, backward: str) -> None:
    """GA=2: the engine divides by 2. With ``loss.backward()`` that division (and the backward prologue) comes
    only from the hooks the engine's forward puts on the output, i.e. from routing through it."""
    opts = {"gradient_accumulation_steps": 2, "backward": backward, "zero": NO_PERSIST if stage == 3 else {}}
    _assert_exact(_run(pool, Cell(wrapper=f"zero{stage}", loss="fused_ce", steps=2, accum=2, wrapper_opts=opts)))


def test_zero2_torch_backward_unrouted_misses_forward_hooks(pool: RankPool) -> None:
    """The same GA=2 case unrouted: no output hooks, no prologue, no 1/GA scaling: fails or is wrong."""
    opts = {"gradient_accumulation_steps": 2, "backward": "torch"}
    cell = Cell(wrapper="zero2", loss="fused_ce", accum=2, routed=False, wrapper_opts=opts)
    try:
        results = pool.run(run_cell, cell)
    except RankFailure as failure:  # measured: ZeRO-2's step finds no reduced gradients (KeyError)
        assert set(failure.errors) == {0, 1}, f"failed on ranks {sorted(failure.errors)}, not on both"
        return
    assert all(r.error is not None or r.max_ref_diff > 1e-3 for r in results), results


@pytest.mark.parametrize("persist", [False, True])
def test_zero3_explicit_gather_exact(pool: RankPool, persist: bool) -> None:
    opts = {} if persist else {"zero": NO_PERSIST}
    pool.run(rankside_deepspeed.gathering_exact, Cell(wrapper="zero3", loss="fused_ce", steps=2, wrapper_opts=opts))


def test_zero3_explicit_gather_liger_dpo_exact(pool: RankPool) -> None:
    pytest.importorskip("liger_kernel", reason="the Liger DPO loss needs liger-kernel")
    cell = Cell(wrapper="zero3", loss="liger_dpo", wrapper_opts={"zero": NO_PERSIST})
    pool.run(rankside_deepspeed.gathering_exact, cell)


def test_zero3_in_forward_vs_gathered_parameters_timing(pool: RankPool) -> None:
    lazy = max(pool.run(rankside_deepspeed.time_zero3_gathering, 3, False))
    gathered = max(pool.run(rankside_deepspeed.time_zero3_gathering, 3, True))
    print(f"ZeRO-3 routed step: in-forward getter {lazy * 1e3:.1f} ms, GatheredParameters {gathered * 1e3:.1f} ms")
    assert lazy > 0 and gathered > 0, f"a step timed at {lazy} s (in-forward getter), {gathered} s (gathered)"


@pytest.mark.parametrize("stage", [0, 3])
def test_detect_zero(pool: RankPool, stage: int) -> None:
    pool.run(rankside_deepspeed.zero_detection, stage)


def test_zero3_gather_outside_model_is_rejected(pool: RankPool) -> None:
    pool.run(rankside_deepspeed.zero3_bad_gather)


def test_every_fetch_coordinator_is_asked_as_the_release_defines_it() -> None:
    """Unit-level, beside the real ZeRO-3 runs above: the installed ``get_param_coordinator`` (its code, on an
    object holding only what it reads) and one of the shape DeepSpeed had before 0.15.4 (a coordinator per
    ``training`` flag): every coordinator each keeps is found."""
    import inspect

    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    from wrapperroute.adapters.deepspeed import _param_coordinators

    class Installed(DeepSpeedZeRoOffload):
        def __init__(self) -> None:  # what either shape of the method reads
            self.param_coordinator = "the one"
            self.param_coordinators = {True: "training", False: "eval"}

    per_mode = len(inspect.signature(DeepSpeedZeRoOffload.get_param_coordinator).parameters) > 1
    found = _param_coordinators(Installed())
    assert found == (["training", "eval"] if per_mode else ["the one"]), f"the installed shape's coordinators: {found}"

    class Before0154:
        def get_param_coordinator(self, training: bool) -> str:
            return f"training={training}"

    found = _param_coordinators(Before0154())
    assert found == ["training=True", "training=False"], f"the pre-0.15.4 shape's coordinators: {found}"
