"""Gradient truth through real DDP on 2 gloo ranks.

Each routed cell must give bit-identical gradients across ranks and match a single process on the global
batch to 1e-6; the unrouted cell in the same test must differ, or the test could not fail.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Iterator

import pytest
import rankside_route_ddp

from wrapperroute.check.cell import REFERENCE_TOLERANCE, Cell, run_cell
from wrapperroute.check.losses import LOSSES
from wrapperroute.check.models import TinyConfig
from wrapperroute.ranks import RankPool

HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
# DDP itself, and the two setups that run a DDP forward without the wrapper object or inside another layer.
COMPOSED_DDP = ["ddp", "replicate"] + (["fabric_ddp"] if importlib.util.find_spec("lightning") else [])

SETTINGS = {
    "default": {},
    "find_unused": {"find_unused_parameters": True},
    "static_graph": {"static_graph": True},
    "bucket_view": {"gradient_as_bucket_view": True},
    "no_sync_accum": {},  # 2 micro-batches under no_sync, then the sync step
}


def _loss_param(name: str) -> object:
    marks = []
    if LOSSES[name].requires == "liger_kernel" and not HAS_LIGER:
        marks.append(pytest.mark.skip(reason="liger-kernel is not installed (pip install wrapperroute[liger])"))
    return pytest.param(name, marks=marks, id=name)


def _cell(loss: str, setting: str, routed: bool) -> Cell:
    config = LOSSES[loss].config
    if setting == "find_unused":  # a parameter no loss touches, so the reducer must skip it
        config = TinyConfig(**{**config.__dict__, "unused": True})
    return Cell(
        wrapper="ddp",
        loss=loss,
        routed=routed,
        steps=3,  # with SGD in between: the reducer state must be clean from step to step
        accum=3 if setting == "no_sync_accum" else 1,
        wrapper_opts=SETTINGS[setting],
        config=config,
    )


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("loss", [_loss_param(n) for n in LOSSES])
def test_gradient_truth(pool: RankPool, loss: str, setting: str) -> None:
    routed = pool.run(run_cell, _cell(loss, setting, routed=True))
    for rank in routed:
        assert rank.error is None, rank.error
        assert rank.params > 0, f"no gradient compared: {rank}"
        assert rank.differ == 0, rank
        assert rank.max_ref_diff <= REFERENCE_TOLERANCE, rank
    assert routed[0].losses != routed[1].losses, "ranks must see different data"

    unrouted = pool.run(run_cell, _cell(loss, setting, routed=False))
    for rank in unrouted:
        assert rank.error is None, rank.error
        assert rank.differ > 0, f"the unrouted path should desync, or this test proves nothing: {rank}"
        assert rank.max_ref_diff > 1e-4, rank


@pytest.fixture(scope="module")
def compile_pool() -> Iterator[RankPool]:
    """Two ranks of their own for the tests whose loss must fail on a first compile: earlier tests in the shared
    pool (DeepSpeed, accelerate) leave compiler state behind that a Dynamo reset does not clear. Each of these
    tests compiles afresh (``fresh_compile``), and a compile that failed once fails again, so they share it."""
    with RankPool(2) as pool:
        yield pool


@pytest.mark.skipif(not HAS_LIGER, reason="liger-kernel is not installed (pip install wrapperroute[liger])")
def test_functorch_crash_reproduced_and_fallback_exact(compile_pool: RankPool) -> None:
    """The upstream crash: compiled Liger DPO with an unfrozen reference head, hidden 256, vocab 8192.

    Compiled fresh inside DDP's forward, plain forward redirection crashes; the default mode falls back by
    itself and is exact. The same under composable replicate (its pre-hook sets DDP's forward marker) and
    Fabric over DDP, each compiled afresh.
    """
    for wrapper in COMPOSED_DDP:
        _crash_then_fallback(compile_pool, wrapper)


def _crash_then_fallback(pool: RankPool, wrapper: str) -> None:
    crashed = pool.run(run_cell, Cell(wrapper, loss="liger_dpo", mode="redirect", fresh_compile=True))
    for rank in crashed:
        assert rank.error is not None and "Cannot access storage of TensorWrapper" in rank.error, rank

    fixed = pool.run(run_cell, Cell(wrapper, loss="liger_dpo", mode="auto", steps=3, fresh_compile=True))
    for rank in fixed:
        assert rank.error is None, rank.error
        assert rank.fell_back, "auto mode should have engaged the fallback on a fresh compile"
        assert rank.differ == 0 and rank.max_ref_diff <= REFERENCE_TOLERANCE, rank

    isolated = pool.run(run_cell, Cell(wrapper, loss="liger_dpo", mode="isolate", fresh_compile=True))
    for rank in isolated:
        assert rank.error is None, rank.error
        assert not rank.fell_back, "isolate mode needs no failed first attempt"
        assert rank.differ == 0 and rank.max_ref_diff <= REFERENCE_TOLERANCE, rank


@pytest.mark.skipif(not HAS_LIGER, reason="liger-kernel is not installed (pip install wrapperroute[liger])")
@pytest.mark.parametrize(("mode", "expect"), [("redirect", "crash"), ("auto", "fallback")])
def test_failed_compile_leaves_saved_tensor_hooks_on(compile_pool: RankPool, mode: str, expect: str) -> None:
    compile_pool.run(rankside_route_ddp.saved_tensor_hooks_after, mode, expect)


def test_no_sync_defers_allreduce(pool: RankPool) -> None:
    pool.run(rankside_route_ddp.no_sync_skips_allreduce)


def test_exception_in_fn_restores_and_next_step_exact(pool: RankPool) -> None:
    pool.run(rankside_route_ddp.fn_raises_then_exact)


def test_nested_route_enters_wrapper_once(pool: RankPool) -> None:
    pool.run(rankside_route_ddp.nested_runs_once)


@pytest.mark.parametrize("find_unused", [False, True], ids=["default", "find_unused"])
def test_pytree_outputs(pool: RankPool, find_unused: bool) -> None:
    pool.run(rankside_route_ddp.pytree_outputs, find_unused)


def test_threads_keep_their_payloads(pool: RankPool) -> None:
    pool.run(rankside_route_ddp.threads_keep_their_payloads)


def test_stale_ddp_forward_marker_neither_skips_routing_nor_stays(pool: RankPool) -> None:
    pool.run(rankside_route_ddp.stale_ddp_marker)


def test_through_compile_layers(pool: RankPool) -> None:
    pool.run(rankside_route_ddp.compiled_layers)


def test_a_compiled_step_that_routes(pool: RankPool) -> None:
    pool.run(rankside_route_ddp.compiled_step_routes)


def test_importing_leaves_the_heavy_packages_unimported() -> None:
    """Dynamo (with sympy and triton), FSDP and DTensor (together over 1.5 s here) are imported by the user's own
    torch.compile and fully_shard, not by wrapperroute: every rank of every run imports wrapperroute."""
    probe = ("import sys, wrapperroute, wrapperroute.cli; heavy = ('torch._dynamo', 'torch.distributed.fsdp', "
             "'torch.distributed.tensor'); print(sorted(m for m in sys.modules if m.startswith(heavy)))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr[-2000:]
