"""Reliability: bad input, faults, one failing rank, long runs and threads, on real wrappers.

Every rank-side function catches the errors it expects and returns them as data, so the pool is never
restarted on the happy path.
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
from wrapperroute.check.cell import REFERENCE_TOLERANCE
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


def _exact(step: dict[str, Any]) -> None:
    assert step["params"] > 0 and step["differ"] == 0 and step["max_ref_diff"] <= REFERENCE_TOLERANCE, step


# --- bad input: single process ------------------------------------------------------------------------------


def _hooks(module: nn.Module) -> int:
    return rr.hook_count(module)


def _plain_case(call: Any, error: type[Exception], words: str) -> None:
    model = build_model(TinyConfig())
    hooks = _hooks(model)
    with pytest.raises(error, match=words) as info:
        call(model)
    assert isinstance(info.value, wr.WrapperRouteError)
    assert "forward" not in model.__dict__ and _hooks(model) == hooks
    ids = torch.zeros(1, 4, dtype=torch.long)
    assert wr.route_loss(model, model, lambda: model(ids).sum()).shape == ()  # still usable


def test_bad_input_model_is_a_class() -> None:
    _plain_case(lambda m: wr.route_loss(type(m), None, lambda: 0), wr.RouteTypeError, "got type")


def test_bad_input_gather_by_name() -> None:
    _plain_case(
        lambda m: wr.route_loss(m, m, lambda: 0, gather="lm_head"), wr.RouteTypeError, r"get_submodule\('lm_head'\)"
    )


def test_model_without_parameters_is_a_plain_call() -> None:
    """Legitimate: nothing to synchronise, so fn is simply called (DDP itself refuses such a model)."""
    model = nn.Sequential(nn.ReLU())
    assert wr.route_loss(model, model, lambda x: model(x).sum(), torch.tensor([-1.0, 2.0])) == 2.0
    assert "forward" not in model.__dict__


def test_bad_input_process_group_gone(tmp_path: Any) -> None:
    """A real (one-rank) DDP whose process group was destroyed: a RouteStateError naming init_process_group."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = build_model(TinyConfig())
        ddp = DDP(model)
    finally:
        dist.destroy_process_group()
    hooks = _hooks(ddp)
    with pytest.raises(wr.RouteStateError, match="init_process_group") as info:
        wr.route_loss(ddp, model, lambda: model(torch.zeros(1, 2, dtype=torch.long)).sum())
    assert isinstance(info.value, RuntimeError)
    assert "forward" not in model.__dict__ and "forward" not in ddp.__dict__ and _hooks(ddp) == hooks


# --- bad input and legitimate odd uses on real wrappers -----------------------------------------------------


@pytest.fixture(scope="module")
def bad_input(pool: RankPool) -> list[dict[str, dict[str, Any]]]:
    return pool.run(inputs.bad_input_cases)


BAD_INPUT = {
    "unwrapped-is-the-wrapper": ("RouteValueError", "wrapper layer itself"),
    "unwrapped-of-another-model": ("RouteValueError", "is not inside model"),
    "gather-outside-fsdp2": ("RouteValueError", "is not inside model"),
    "gather-by-name": ("RouteTypeError", "not names"),
    "no-tensor-find-unused": ("RouteValueError", "find_unused_parameters=True"),
    "detached-find-unused": ("RouteValueError", "no tensor that requires grad"),
    "async-fn": ("RouteTypeError", "coroutine"),
    "generator-fn": ("RouteTypeError", "generator"),
    "async-fn-fsdp2": ("RouteTypeError", "coroutine"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_on_wrapper(bad_input: list[dict[str, dict[str, Any]]], case: str) -> None:
    error, words = BAD_INPUT[case]
    for rank in bad_input:
        entry = rank[case]
        assert entry["error"] == error and words in entry["message"], entry
        assert "WrapperRouteError" in entry["mro"] and ("TypeError" in entry["mro"] or "ValueError" in entry["mro"])
        assert entry["clean"], f"state left behind: {entry}"
        _exact(entry["after"])  # the same wrapper, next step


def test_bad_input_messages_name_the_fix(bad_input: list[dict[str, dict[str, Any]]]) -> None:
    fixes = {"no-tensor-find-unused": "torch.no_grad()", "async-fn": "plain function", "gather-by-name": "submodule"}
    for case, fix in fixes.items():
        assert fix in bad_input[0][case]["message"], bad_input[0][case]


@pytest.fixture(scope="module")
def legit(pool: RankPool) -> list[dict[str, dict[str, Any]]]:
    return pool.run(inputs.legit_cases)


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp1", "fsdp2"])
def test_no_grad_evaluation_is_routed(legit: list[dict[str, dict[str, Any]]], wrapper: str) -> None:
    for rank in legit:
        facts = rank[f"no_grad-{wrapper}"]
        assert facts["value_diff"] <= REFERENCE_TOLERANCE and not facts["requires_grad"], facts
        assert facts["clean"], facts  # FSDP resharded, no forward left, no hook leaked
        _exact(facts["after"])


def test_eval_mode_is_routed(legit: list[dict[str, dict[str, Any]]]) -> None:
    for rank in legit:
        facts = rank["eval-mode-fsdp2"]
        _exact(facts)
        assert facts["modes_kept"]


def test_route_from_inside_the_wrappers_forward(legit: list[dict[str, dict[str, Any]]]) -> None:
    for rank in legit:
        facts = rank["inside-own-forward-ddp"]
        assert (
            facts["forward_calls"] == 1 and facts["differ"] == 0 and facts["max_ref_diff"] <= REFERENCE_TOLERANCE
        ), facts


def test_lazy_fn_rejected_without_wrapper_is_a_plain_call() -> None:
    """Without a wrapper nothing is routed: an async fn's coroutine comes back as is (the caller awaits it)."""
    model = build_model(TinyConfig())

    async def loss() -> int:
        return 3

    assert asyncio.run(wr.route_loss(model, model, loss)) == 3


# --- faults -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("wrapper", "opts"), WRAPPERS)
def test_exception_in_fn_on_every_rank(pool: RankPool, wrapper: str, opts: dict[str, Any]) -> None:
    for rank in pool.run(faults.fault_then_exact, wrapper, opts):
        assert rank["raised"] == "ValueError: boom inside the loss"
        assert rank["after"] == rank["before"], rank  # forward, hooks, layout, in-forward flags
        assert rank["after"]["sharded"] and not rank["after"]["in_forward"]
        for step in rank["steps"]:
            _exact(step)
        assert rank["end"] == rank["before"]


@pytest.mark.parametrize(
    ("wrapper", "opts"),
    [pytest.param("fsdp2", {"groups": "layers"}, id="fsdp2"), pytest.param("ddp", {}, id="ddp"), REPLICATE, FABRIC],
)
def test_keyboard_interrupt_in_fn(pool: RankPool, wrapper: str, opts: dict[str, Any]) -> None:
    for rank in pool.run(faults.fault_then_exact, wrapper, opts, True):
        assert rank["raised"].startswith("KeyboardInterrupt")
        assert rank["after"] == rank["before"], rank
        for step in rank["steps"]:
            _exact(step)


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
    for rank in pool.run(faults.interrupt_anywhere, wrapper, opts, timeout=600):
        assert rank["points"] > 30 and not rank["broken"], rank["broken"]
        assert len(rank["steps"]) == rank["points"] + 1
        for step in rank["steps"]:
            _exact(step)


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
    ranks = pool.run(faults.one_rank_fails_agreed, wrapper, opts, timeout=120)
    for index, rank in enumerate(ranks):
        assert rank["raised"] == "RouteStateError", rank
        assert "failed on rank(s) [1]" in rank["message"], rank
        assert rank["cause"] == ("ValueError" if index == 1 else "NoneType"), rank
        assert rank["clean"] and rank["agreed_ok"], rank
        _exact(rank["next"])


def test_one_rank_fails_without_agree_is_bounded_by_the_group_timeout(pool: RankPool) -> None:
    waiting, failed = pool.run(faults.one_rank_fails_bounded, 3.0, timeout=60)
    assert failed["error"] == "ValueError: only rank 1 fails"
    assert waiting["error"] is not None and "Timed out" in waiting["error"], waiting
    assert 2.5 <= waiting["seconds"] <= 30, waiting
    assert not waiting["forward_left"] and not failed["forward_left"]


# --- long run -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("wrapper", "opts", "steps"), [("ddp", {}, 1000), ("fsdp2", {"groups": "layers"}, 150)], ids=["ddp", "fsdp2"]
)
def test_long_run(pool: RankPool, wrapper: str, opts: dict[str, Any], steps: int) -> None:
    """1,000 DDP steps (FSDP2, ~40 ms a step on 2 CPU ranks, runs 150 to stay in the suite's budget)."""
    for rank in pool.run(lifetime.long_run, wrapper, opts, steps, 50, timeout=300):
        assert rank["steps"] == steps
        assert rank["forward_changed"] == 0 and rank["hooks_changed"] == 0, rank
        assert rank["rss_growth_mib"] <= 5.0, rank


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
    for control, routed in zip(
        pool.run(lifetime.released, wrapper, opts, False, timeout=120),
        pool.run(lifetime.released, wrapper, opts, True, timeout=120),
        strict=True,
    ):
        assert not control["inner_alive"] and not control["model_alive"], control  # collectable unrouted
        assert not routed["inner_alive"] and not routed["model_alive"], routed
        assert routed["plans_added"] == 0 and routed["redirections_added"] == 0, routed


# --- edge cases found in review -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def edges(pool: RankPool) -> list[dict[str, Any]]:
    return pool.run(edge_cases.edge_cases, timeout=120)


def test_agree_with_a_gather_iterator_unshards_what_it_names(edges: list[dict[str, Any]]) -> None:
    # agree=True reran the call with the iterator already used up: embed stayed sharded (a DTensor)
    for rank in edges:
        assert rank["agree_gather_iterator"] == {False: "Parameter", True: "Parameter"}, rank


def test_two_wrappers_over_one_module_are_both_restored(edges: list[dict[str, Any]]) -> None:
    # the second wrapper took the passthrough's slot: the first kept the passthrough for good
    for rank in edges:
        assert rank["two_wrappers_left"] == [False, False, False], rank


def test_autocast_forward_put_back_is_kept_again(edges: list[dict[str, Any]]) -> None:
    for rank in edges:
        assert rank["kept_autocast"] == ["torch.bfloat16", "torch.float32", "torch.bfloat16"], rank


def test_plain_call_that_read_the_passthrough_runs_after_the_loss_ended(edges: list[dict[str, Any]]) -> None:
    for rank in edges:
        assert rank["plain_thread_after_loss"] == {"shape": [2, 4]}, rank


def test_model_sharded_after_its_first_call_is_routed(edges: list[dict[str, Any]]) -> None:
    for rank in edges:
        assert rank["sharded_after_first_call"] == "FORWARD", rank


# --- threads ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def threads(pool: RankPool) -> list[dict[str, Any]]:
    return pool.run(concurrency.threads_cases, timeout=120)


def test_threads_two_models_with_grad(threads: list[dict[str, Any]]) -> None:
    for rank in threads:
        facts = rank["two_models"]
        assert not facts["errors"] and facts["differ"] == 0 and facts["max_ref_diff"] <= REFERENCE_TOLERANCE, facts
        assert not facts["forward_left"]


def test_threads_train_and_evaluate_one_model(threads: list[dict[str, Any]]) -> None:
    for rank in threads:
        facts = rank["train_and_eval"]
        assert not facts["errors"], facts
        assert facts["differ"] == 0 and facts["max_ref_diff"] <= REFERENCE_TOLERANCE, facts
        assert facts["eval_diff"] is not None and facts["eval_diff"] <= REFERENCE_TOLERANCE, facts
        assert not facts["forward_left"]


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_threads_two_grad_forwards_one_model_is_a_clear_error(threads: list[dict[str, Any]], wrapper: str) -> None:
    for rank in threads:
        facts = rank[f"two_grad_{wrapper}"]
        assert facts["first_ok"] and facts["errors"] == ["RouteStateError"], facts
        assert "another thread" in facts["message"] and "Serialise" in facts["message"], facts
        assert facts["differ"] == 0 and facts["clean"], facts


def test_threads_overlapping_on_replicate_keep_its_hooks(threads: list[dict[str, Any]]) -> None:
    for rank in threads:
        facts = rank["train_beside_eval_replicate"]
        assert not facts["errors"] and facts["hooks"][0] > 0 and facts["hooks"][1] == facts["hooks"][0], facts
        assert facts["differ"] == 0, facts


def test_threads_leave_no_stale_ddp_marker(threads: list[dict[str, Any]]) -> None:
    assert not any(rank["marker_left"] for rank in threads)
