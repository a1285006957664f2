"""Gradient truth through torch's composable ``replicate()``, ``replicate`` built on FSDP2, and Lightning
(Fabric over DDP, and a real ``L.Trainer``) on 2 gloo ranks; and what route_loss says about a model it finds
no wrapper on.

Every routed cell: 0 parameters differing across ranks and <= 1e-6 from one process on the global batch; the
unrouted cell in the same test must differ or crash, or the test could not fail.
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

import pytest
import rankside_composable as rc
import torch

import wrapperroute as wr
from wrapperroute.check.cell import REFERENCE_TOLERANCE, Cell, run_cell
from wrapperroute.check.models import TinyConfig, build_model
from wrapperroute.ranks import RankPool

HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
HAS_LIGHTNING = importlib.util.find_spec("lightning") is not None
NEEDS_LIGHTNING = pytest.mark.skipif(not HAS_LIGHTNING, reason="lightning is not installed (wrapperroute[lightning])")
NEEDS_LIGER = pytest.mark.skipif(not HAS_LIGER, reason="liger-kernel is not installed (wrapperroute[liger])")

# (wrapper, options, the loss whose unrouted path shows the bug, what that bug is)
LAYOUTS = {
    "replicate": ("replicate", {}, "backbone_ce", "desync"),
    "replicate-find_unused": ("replicate", {"find_unused_parameters": True}, "backbone_ce", "desync"),
    "replicate-static_graph": ("replicate", {"static_graph": True}, "backbone_ce", "desync"),
    "replicate_fsdp": ("replicate_fsdp", {}, "backbone_ce", "crash"),
    "replicate_fsdp-lm_head_group": ("replicate_fsdp", {"lm_head_group": True}, "backbone_ce", "crash"),
    "fabric_ddp": ("fabric_ddp", {}, "fused_ce", "desync"),
}


def _layout(name: str) -> Any:
    marks = [NEEDS_LIGHTNING] if name.startswith("fabric") else []
    return pytest.param(name, marks=marks, id=name)


def _assert_exact(results: list[dict[str, Any]]) -> None:
    for rank in results:
        assert rank.error is None, rank.error
        assert rank.params > 0 and rank.differ == 0, rank
        assert rank.max_ref_diff <= REFERENCE_TOLERANCE, rank
    assert results[0].losses != results[1].losses, "ranks must see different data"


def _assert_bug(results: list[dict[str, Any]], bug: str) -> None:
    for rank in results:
        if bug == "crash":
            assert rank.error is not None, f"the unrouted path should fail here: {rank}"
        else:
            assert rank.error is None and rank.differ > 0 and rank.max_ref_diff > 1e-4, rank


@pytest.mark.parametrize("layout", [_layout(n) for n in LAYOUTS])
def test_gradient_truth(pool: RankPool, layout: str) -> None:
    wrapper, opts, loss, bug = LAYOUTS[layout]
    config = TinyConfig(unused=True) if opts.get("find_unused_parameters") else None
    for path_loss in {loss, "fused_ce"}:
        _assert_exact(pool.run(run_cell, Cell(wrapper, path_loss, wrapper_opts=opts, steps=3, config=config)))
    _assert_bug(pool.run(run_cell, Cell(wrapper, loss, routed=False, wrapper_opts=opts, config=config)), bug)


@pytest.mark.parametrize("layout", [_layout("replicate"), _layout("replicate_fsdp"), _layout("fabric_ddp")])
def test_accumulation(pool: RankPool, layout: str) -> None:
    """2 micro-batches without gradient sync (set_requires_gradient_sync(False), Fabric's no_backward_sync),
    then a sync step."""
    wrapper, opts, loss, _ = LAYOUTS[layout]
    _assert_exact(pool.run(run_cell, Cell(wrapper, loss, wrapper_opts=opts, accum=3, steps=2)))


@NEEDS_LIGER
@pytest.mark.parametrize("layout", [_layout("replicate"), _layout("fabric_ddp")])
@pytest.mark.parametrize("loss", ["liger_dpo", "liger_kto"])
def test_liger_losses(pool: RankPool, layout: str, loss: str) -> None:
    """Compiled torch.func losses: replicate's pre-hook sets DDP's forward marker, so the functorch fallback
    applies as under DDP. Unrouted: Fabric's loss reads the module (desync); replicate's calls its root, whose
    hooks arm the reducer (in sync), so that path proves nothing there and is checked with backbone_ce above."""
    wrapper, opts, _, _ = LAYOUTS[layout]
    _assert_exact(pool.run(run_cell, Cell(wrapper, loss, wrapper_opts=opts, steps=2)))
    if wrapper == "fabric_ddp":
        _assert_bug(pool.run(run_cell, Cell(wrapper, loss, routed=False, wrapper_opts=opts)), "desync")


def test_detect_names_each_kind(pool: RankPool) -> None:
    expected = {
        "replicate": ("replicate", ("replicate", "module")),
        "replicate_fsdp": ("replicate_fsdp", ("replicate_fsdp", "module")),
    }
    if HAS_LIGHTNING:
        expected["fabric_ddp"] = ("ddp", ("fabric", "ddp", "module"))
    pool.run(rc.detected, expected, timeout=120)


def test_sync_tools_cover_replicate(pool: RankPool) -> None:
    """guard raises and check_grad_sync counts the desync of an unrouted replicate step; routed, both agree
    the ranks are in sync. replicate_fsdp's replicated gradients are compared too (not skipped as shards)."""
    pool.run(rc.sync_tools, "replicate", False)
    for wrapper in ("replicate", "replicate_fsdp"):
        pool.run(rc.sync_tools, wrapper, True)


@NEEDS_LIGHTNING
def test_fabric_precision_context_reaches_the_loss(pool: RankPool) -> None:
    """precision="bf16-mixed": routed, the loss runs under Fabric's autocast (bf16 logits) and the ranks
    agree; computed on fabric_module.module, it runs in fp32 outside autocast and the ranks diverge."""
    pool.run(rc.fabric_autocast, True)
    pool.run(rc.fabric_autocast, False)


@NEEDS_LIGHTNING
@pytest.mark.parametrize("holder", ["strategy_model", "self"])
def test_lightning_trainer_training_step(pool: RankPool, holder: str) -> None:
    """training_step already runs inside the strategy's DDP forward: route_loss sees that and calls the loss
    directly (not entered a second time), exact, and quiet. The same call from a hook outside the forward
    warns: quiet inside is not silence everywhere. (Measured: in a Trainer every path, a direct loss and a
    second redirection through the wrapper alike, is exact, because the step is inside the wrapper already.)"""
    pool.run(rc.lightning_trainer_step, holder, timeout=300)


# --- never silent ---------------------------------------------------------------------------------------------


def test_warns_once_for_a_hand_rolled_wrapper(pool: RankPool) -> None:
    pool.run(rc.warns_once_for_a_hand_rolled_wrapper)


def test_quiet_for_a_frozen_module(pool: RankPool) -> None:
    pool.run(rc.quiet_for_a_frozen_module)


def test_quiet_under_no_grad_until_a_call_with_grad(pool: RankPool) -> None:
    pool.run(rc.quiet_under_no_grad_until_a_call_with_grad)


def test_unknown_composable_state_is_an_error(pool: RankPool) -> None:
    pool.run(rc.unknown_composable_state_is_an_error)


def test_quiet_in_one_process() -> None:
    model = build_model(TinyConfig())
    ids = torch.zeros(1, 4, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        for _ in range(2):
            shape = wr.route_loss(model, None, lambda: model(ids).sum()).shape
            assert shape == (), f"the routed loss has shape {tuple(shape)}"
