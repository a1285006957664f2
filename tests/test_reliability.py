"""Reliability: bad input, faults, one failing rank, long runs and threads, on real wrappers.

Every rank-side function (tests/rankside_reliability) asserts its facts where it finds them and catches the
errors it expects, so the pool is never restarted on the happy path.
"""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import pytest
import rankside_reliability as rr
import torch
from rankside_reliability import concurrency, edge_cases, faults, inputs, lifetime
from torch import nn

import wrapperroute as wr
from wrapperroute.check.models import TinyConfig, build_model
from wrapperroute.ranks import RankPool

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
NEEDS_DS = pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed (pip install wrapperroute[ds])")
NEEDS_LIGHTNING = pytest.mark.skipif(
    importlib.util.find_spec("lightning") is None, reason="lightning is not installed (wrapperroute[lightning])"
)
REPLICATE = pytest.param("replicate", {}, id="replicate")
FABRIC = pytest.param("fabric_ddp", {}, id="fabric_ddp", marks=NEEDS_LIGHTNING)
ZERO3 = {"zero": {"stage3_param_persistence_threshold": 0}}  # partition even the tiny model's parameters
WRAPPERS = [
    pytest.param("ddp", {}, id="ddp"),
    pytest.param("ddp", {"find_unused_parameters": True}, id="ddp-find_unused"),
    REPLICATE,
    pytest.param("replicate", {"find_unused_parameters": True}, id="replicate-find_unused"),
    FABRIC,
    pytest.param("fsdp1", {}, id="fsdp1"),
    pytest.param("fsdp1", {"lm_head_unit": True}, id="fsdp1-lm_head_unit"),
    pytest.param("fsdp2", {}, id="fsdp2"),
    pytest.param("fsdp2", {"groups": "layers"}, id="fsdp2-layers"),
    pytest.param("replicate_fsdp", {"lm_head_group": True}, id="replicate_fsdp-lm_head_group"),
    *(pytest.param(f"zero{s}", {}, id=f"zero{s}", marks=NEEDS_DS) for s in range(3)),
    pytest.param("zero3", ZERO3, id="zero3", marks=NEEDS_DS),
]


# --- bad input: single process ------------------------------------------------------------------------------


def _hooks(module: nn.Module) -> int:
    return rr.hook_count(module)


def _plain_case(call: Any, error: type[Exception], words: str) -> None:
    model = build_model(TinyConfig())
    hooks = _hooks(model)
    with pytest.raises(error, match=words) as info:
        call(model)
    assert isinstance(info.value, wr.WrapperRouteError), f"{info.value!r} is not a WrapperRouteError"
    assert "forward" not in model.__dict__, "the failed call left an instance forward"
    assert _hooks(model) == hooks, f"{hooks} hooks before the failed call, {_hooks(model)} after"
    ids = torch.zeros(1, 4, dtype=torch.long)
    shape = wr.route_loss(model, model, lambda: model(ids).sum()).shape
    assert shape == (), f"the next routed loss has shape {tuple(shape)}: the model is not usable"


def test_bad_input_model_is_a_class() -> None:
    _plain_case(lambda m: wr.route_loss(type(m), None, lambda: 0), wr.RouteTypeError, "got type")


def test_bad_input_gather_by_name() -> None:
    _plain_case(
        lambda m: wr.route_loss(m, m, lambda: 0, gather="lm_head"), wr.RouteTypeError, r"get_submodule\('lm_head'\)"
    )


def test_model_without_parameters_is_a_plain_call() -> None:
    """Legitimate: nothing to synchronise, so fn is simply called (DDP itself refuses such a model)."""
    model = nn.Sequential(nn.ReLU())
    value = wr.route_loss(model, model, lambda x: model(x).sum(), torch.tensor([-1.0, 2.0]))
    assert value == 2.0, f"fn's value {value}, not relu([-1, 2]).sum() = 2"
    assert "forward" not in model.__dict__, "the call left an instance forward"


def test_bad_input_process_group_gone(tmp_path: Any) -> None:
    """A real (one-rank) DDP whose process group was destroyed: a RouteStateError naming init_process_group."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    assert not dist.is_initialized(), "a process group is already initialised in the test process"
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = build_model(TinyConfig())
        ddp = DDP(model)
    finally:
        dist.destroy_process_group()
    hooks = _hooks(ddp)
    with pytest.raises(wr.RouteStateError, match="init_process_group") as info:
        wr.route_loss(ddp, model, lambda: model(torch.zeros(1, 2, dtype=torch.long)).sum())
    assert isinstance(info.value, RuntimeError), f"{info.value!r} is not a RuntimeError"
    assert "forward" not in model.__dict__ and "forward" not in ddp.__dict__, "an instance forward was left"
    assert _hooks(ddp) == hooks, f"{hooks} hooks before the failed call, {_hooks(ddp)} after"


# --- bad input and legitimate odd uses on real wrappers -----------------------------------------------------


# case: (the exception, words its message holds, the fix it names or None); a DDP model, or FSDP2 for "-fsdp2"
BAD_INPUT = {
    "unwrapped-is-the-wrapper": ("RouteValueError", "wrapper layer itself", None),
    "unwrapped-of-another-model": ("RouteValueError", "is not inside model", None),
    "gather-outside-fsdp2": ("RouteValueError", "is not inside model", None),
    "gather-by-name": ("RouteTypeError", "not names", "submodule"),
    "no-tensor-find-unused": ("RouteValueError", "find_unused_parameters=True", "torch.no_grad()"),
    "detached-find-unused": ("RouteValueError", "no tensor that requires grad", None),
    "async-fn": ("RouteTypeError", "coroutine", "plain function"),
    "generator-fn": ("RouteTypeError", "generator", None),
    "async-fn-fsdp2": ("RouteTypeError", "coroutine", None),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_on_wrapper(pool: RankPool, case: str) -> None:
    """The error, its message (naming the fix where there is one), the wrapper as it was, the next step exact."""
    pool.run(inputs.bad_input, case, *BAD_INPUT[case])


NO_GRAD = {"ddp": {}, "fsdp1": {"lm_head_unit": True}, "fsdp2": {"groups": "layers"}}


@pytest.mark.parametrize("wrapper", list(NO_GRAD))
def test_no_grad_evaluation_is_routed(pool: RankPool, wrapper: str) -> None:
    pool.run(inputs.no_grad_evaluation, wrapper, NO_GRAD[wrapper])


def test_eval_mode_is_routed(pool: RankPool) -> None:
    pool.run(inputs.eval_mode)


def test_route_from_inside_the_wrappers_forward(pool: RankPool) -> None:
    pool.run(inputs.inside_own_forward)


def test_lazy_fn_rejected_without_wrapper_is_a_plain_call() -> None:
    """Without a wrapper nothing is routed: an async fn's coroutine comes back as is (the caller awaits it)."""
    model = build_model(TinyConfig())

    async def loss() -> int:
        return 3

    value = asyncio.run(wr.route_loss(model, model, loss))
    assert value == 3, f"the awaited coroutine gave {value!r}, not fn's 3"


# --- faults -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("wrapper", "opts"), WRAPPERS)
def test_exception_in_fn_on_every_rank(pool: RankPool, wrapper: str, opts: dict[str, Any]) -> None:
    pool.run(faults.fault_then_exact, wrapper, opts)


@pytest.mark.parametrize(
    ("wrapper", "opts"),
    [pytest.param("fsdp2", {"groups": "layers"}, id="fsdp2"), pytest.param("ddp", {}, id="ddp"), REPLICATE, FABRIC],
)
def test_keyboard_interrupt_in_fn(pool: RankPool, wrapper: str, opts: dict[str, Any]) -> None:
    pool.run(faults.fault_then_exact, wrapper, opts, True)


INTERRUPTED = [
    pytest.param("ddp", {}, id="ddp"),
    pytest.param("ddp", {"find_unused_parameters": True}, id="ddp-find_unused"),
    REPLICATE,
    FABRIC,
    pytest.param("fsdp1", {"lm_head_unit": True}, id="fsdp1-lm_head_unit"),
    pytest.param("fsdp2", {"groups": "layers"}, id="fsdp2-layers"),
    pytest.param("zero3", ZERO3, id="zero3", marks=NEEDS_DS),
]


@pytest.mark.parametrize(("wrapper", "opts"), INTERRUPTED)
def test_keyboard_interrupt_anywhere(pool: RankPool, wrapper: str, opts: dict[str, Any]) -> None:
    """Ctrl-C at each point of a routed call where Python could raise it, on both ranks: nothing left behind,
    and the next step exact (one-rank version with training calls: tests/test_route_interrupts.py)."""
    pool.run(faults.interrupt_anywhere, wrapper, opts, timeout=600)


AGREE = [
    pytest.param("ddp", {}, id="ddp"),
    REPLICATE,
    FABRIC,
    pytest.param("fsdp1", {"lm_head_unit": True}, id="fsdp1"),
    pytest.param("fsdp2", {"groups": "layers"}, id="fsdp2"),
    pytest.param("zero3", ZERO3, id="zero3", marks=NEEDS_DS),
]


@pytest.mark.parametrize(("wrapper", "opts"), AGREE)
def test_one_rank_fails_with_agree(pool: RankPool, wrapper: str, opts: dict[str, Any]) -> None:
    pool.run(faults.one_rank_fails_agreed, wrapper, opts, timeout=120)


def test_one_rank_fails_without_agree_is_bounded_by_the_group_timeout(pool: RankPool) -> None:
    """Rank 1 fails; rank 0 waits for the group's 3 s timeout: raised within 2.5 to 30 s."""
    pool.run(faults.one_rank_fails_bounded, 3.0, (2.5, 30.0), timeout=60)


# --- long run -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("wrapper", "opts", "steps"), [("ddp", {}, 1000), ("fsdp2", {"groups": "layers"}, 150)], ids=["ddp", "fsdp2"]
)
def test_long_run(pool: RankPool, wrapper: str, opts: dict[str, Any], steps: int) -> None:
    """1,000 DDP steps (FSDP2, ~40 ms a step on 2 CPU ranks, runs 150 to stay in the suite's budget)."""
    pool.run(lifetime.long_run, wrapper, opts, steps, 50, 5.0, timeout=300)


@pytest.mark.parametrize(
    ("wrapper", "opts"),
    [
        pytest.param("ddp", {}, id="ddp"),
        pytest.param("fsdp1", {"lm_head_unit": True}, id="fsdp1-lm_head_unit"),
        pytest.param("fsdp2", {"groups": "layers"}, id="fsdp2-layers"),
    ],
)
def test_routing_does_not_keep_the_model_alive(pool: RankPool, wrapper: str, opts: dict[str, Any]) -> None:
    """A routed model is freed with its last reference (a notebook or sweep that builds one model per run
    must not accumulate every model's parameters): route_loss and the adapters' caches hold modules only
    weakly. (All three failed before the fix: the per-model plan, and the FSDP units cache through FSDP's
    own state, held the model strongly.) Not DeepSpeed: the control fails there, deepspeed itself keeps
    every engine alive."""
    pool.run(lifetime.released, wrapper, opts, False, timeout=120)  # the control: collectable unrouted
    pool.run(lifetime.released, wrapper, opts, True, timeout=120)


# --- edge cases found in review -----------------------------------------------------------------------------


def test_agree_with_a_gather_iterator_unshards_what_it_names(pool: RankPool) -> None:
    pool.run(edge_cases.agree_gather_iterator, timeout=120)


def test_two_wrappers_over_one_module_are_both_restored(pool: RankPool) -> None:
    pool.run(edge_cases.two_wrappers_restored, timeout=120)


def test_autocast_forward_put_back_is_kept_again(pool: RankPool) -> None:
    pool.run(edge_cases.kept_autocast, timeout=120)


def test_plain_call_that_read_the_passthrough_runs_after_the_loss_ended(pool: RankPool) -> None:
    pool.run(edge_cases.plain_thread_after_loss, timeout=120)


def test_model_sharded_after_its_first_call_is_routed(pool: RankPool) -> None:
    pool.run(edge_cases.sharded_after_first_call, timeout=120)


# --- threads ------------------------------------------------------------------------------------------------
# After each DDP case the next routed call must leave no stale DDP forward marker (checked in the rank).


def test_threads_two_models_with_grad(pool: RankPool) -> None:
    pool.run(concurrency.two_models_with_grad, timeout=120)


def test_threads_train_and_evaluate_one_model(pool: RankPool) -> None:
    pool.run(concurrency.train_and_evaluate_one_model, timeout=120)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_threads_two_grad_forwards_one_model_is_a_clear_error(pool: RankPool, wrapper: str) -> None:
    pool.run(concurrency.two_grad_forwards, wrapper, timeout=120)


def test_threads_overlapping_on_replicate_keep_its_hooks(pool: RankPool) -> None:
    pool.run(concurrency.train_beside_eval, "replicate", timeout=120)
