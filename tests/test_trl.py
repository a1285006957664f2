"""TRL integration: ``ForwardRedirection`` against TRL's own class, and ``patch_trl()`` on real TRL
``DPOTrainer``/``KTOTrainer`` with ``use_liger_kernel=True`` on 2 gloo ranks: the bug and the fix, side by side."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import rankside_trl
import torch
from torch import nn

from wrapperroute.check.trl_cells import compare_ranks, trl_step
from wrapperroute.integrations.trl import ForwardRedirection
from wrapperroute.ranks import RankPool

HAS_TRL = importlib.util.find_spec("trl") is not None
HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
needs_trl = pytest.mark.skipif(not HAS_TRL, reason="trl is not installed (pip install wrapperroute[trl])")


def _defines_liger_loss(trainer: str) -> bool:
    """Whether the installed trainer class defines ``_compute_loss_liger``: the method whose callers skip the
    wrapper (TRL 1.9-1.13 pass it the unwrapped model, earlier releases the wrapper itself). Releases from 1.14
    have none: they route their Liger path themselves (measured with TRL 1.14.2: no desync, no crash). The
    tests measure the bug where the method is, and check TRL stays exact where it is not."""
    from trl import DPOTrainer, KTOTrainer

    cls = DPOTrainer if trainer == "dpo" else KTOTrainer
    return any("_compute_loss_liger" in vars(c) for c in cls.__mro__)  # defined there, or inherited


def test_importing_wrapperroute_never_imports_trl() -> None:
    code = (
        "import sys, wrapperroute, wrapperroute.decorators, wrapperroute.integrations, wrapperroute.integrations.trl;"
        "assert 'trl' not in sys.modules, 'trl was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --- ForwardRedirection: TRL's behaviour tests, run on both classes -------------------------------------------


class Outer(nn.Module):
    """A wrapper wrapperroute does not know: calls its inner module's forward with what it was given."""

    def __init__(self, inner: nn.Module, fail: bool = False) -> None:
        super().__init__()
        self.inner = inner
        self.fail = fail

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.fail:
            raise RuntimeError("wrapper failed before its inner forward")
        return self.inner(*args, **kwargs)


def _classes() -> list[Any]:
    classes: list[Any] = [pytest.param(ForwardRedirection, id="wrapperroute")]
    if HAS_TRL:
        from trl.models.utils import _ForwardRedirection

        classes.append(pytest.param(_ForwardRedirection, id="trl"))
    return classes


@pytest.mark.parametrize("cls", _classes())
@pytest.mark.parametrize("wrapped", [True, False], ids=["unknown-wrapper", "no-wrapper"])
def test_redirection_calls_method_and_restores(cls: Callable[[], Any], wrapped: bool) -> None:
    inner = nn.Linear(2, 2)
    outer = Outer(inner) if wrapped else inner
    x = torch.randn(3, 2)
    seen: list[Any] = []

    def method(a: torch.Tensor, *, scale: float) -> torch.Tensor:
        seen.append(inner(a))  # the real forward, from inside the redirected call
        return a * scale

    out = cls()(outer, inner, method, x, scale=2.0)
    assert torch.equal(out, x * 2.0)
    assert torch.equal(seen[0], nn.functional.linear(x, inner.weight, inner.bias))
    assert torch.equal(inner(x), nn.functional.linear(x, inner.weight, inner.bias))  # forward is the real one again


@pytest.mark.parametrize("cls", _classes())
def test_redirection_hooks_run_in_order(cls: type) -> None:
    events: list[str] = []

    class Hooked(cls):
        def on_after_inner_forward(self, wrapper_module: nn.Module, original_module: nn.Module) -> None:
            events.append("inner")

        def on_after_outer_forward(self, wrapper_module: nn.Module, original_module: nn.Module) -> None:
            events.append("outer")

    inner = nn.Linear(2, 2)
    Hooked()(Outer(inner), inner, lambda: events.append("method"))
    assert events == ["method", "inner", "outer"]


@pytest.mark.parametrize("cls", _classes())
def test_redirection_restores_on_exception(cls: Callable[[], Any]) -> None:
    """Where TRL's class is wrong: a wrapper failing before the inner forward leaves the method installed as
    the module's forward (every later call runs the loss again), and even a clean call leaves an instance
    ``forward`` attribute behind."""
    inner = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="wrapper failed"):
        cls()(Outer(inner, fail=True), inner, lambda *args: "the loss")
    leaked_on_error = inner(torch.randn(1, 2)) == "the loss"  # a later normal call runs the loss
    clean = nn.Linear(2, 2)
    cls()(Outer(clean), clean, lambda: None)
    leaked_attribute = "forward" in clean.__dict__
    if cls is ForwardRedirection:
        assert not leaked_on_error and not leaked_attribute
    else:  # documents TRL's behaviour; if TRL fixes it, drop this branch
        assert leaked_on_error and leaked_attribute


def test_redirection_under_ddp_matches_trl(pool: RankPool) -> None:
    ours = pool.run(rankside_trl.forward_redirection_ddp, False)[0]
    assert ours["differ"] == 0 and ours["max_diff"] == 0.0 and not ours["forward_left"]
    if HAS_TRL:
        theirs = pool.run(rankside_trl.forward_redirection_ddp, True)[0]
        assert theirs["differ"] == 0  # TRL's is correct here: same gradients
        assert theirs["forward_left"]  # ...but leaves an instance forward behind


# --- patch_trl ---------------------------------------------------------------------------------------------


@needs_trl
def test_patch_trl_is_idempotent_and_reversible(monkeypatch: pytest.MonkeyPatch) -> None:
    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.kto_trainer import KTOTrainer

    from wrapperroute.integrations.trl import patch_trl, unpatch_trl

    # TRL 1.14 has no KTOTrainer._compute_loss_liger: None stands for "absent", before and after alike.
    originals = (DPOTrainer.compute_loss, getattr(KTOTrainer, "_compute_loss_liger", None))
    try:
        first = patch_trl()
        second = patch_trl()
        assert first.patched == second.patched
        import trl.models.utils as utils

        assert utils._ForwardRedirection is ForwardRedirection
        import trl.trainer.grpo_trainer as grpo  # imported after the patch: takes ours from trl.models.utils

        # a GRPO trainer that imports TRL's redirection (not every release does) takes ours
        assert getattr(grpo, "_ForwardRedirection", ForwardRedirection) is ForwardRedirection
        if _defines_liger_loss("dpo"):
            assert "trl.trainer.dpo_trainer.DPOTrainer.compute_loss" in first.patched
            assert DPOTrainer.compute_loss is not originals[0]
        else:  # only the redirection is replaced; the note says why
            assert not any("DPOTrainer" in label for label in first.patched), first.patched
            assert "DPOTrainer has no _compute_loss_liger" in first.note and DPOTrainer.compute_loss is originals[0]
        if _defines_liger_loss("kto"):  # patched on the class that defines it (trl.experimental's, before 1.8)
            owner = next(c for c in KTOTrainer.__mro__ if "_compute_loss_liger" in vars(c))
            assert f"{owner.__module__}.{owner.__qualname__}._compute_loss_liger" in first.patched, first.patched
    finally:
        unpatch_trl()
    assert (DPOTrainer.compute_loss, getattr(KTOTrainer, "_compute_loss_liger", None)) == originals
    assert utils._ForwardRedirection is not ForwardRedirection
    assert getattr(grpo, "_ForwardRedirection", utils._ForwardRedirection) is utils._ForwardRedirection  # back too

    from wrapperroute.integrations.trl import _LIGER_TRAINERS

    for module_name, class_name in _LIGER_TRAINERS:  # a TRL whose trainers have no Liger loss method
        cls = getattr(sys.modules.get(module_name), class_name, None)
        for owner in cls.__mro__ if cls is not None else ():
            if "_compute_loss_liger" in vars(owner):
                monkeypatch.delattr(owner, "_compute_loss_liger")
    try:
        result = patch_trl(forward_redirection=False)
        assert result.patched == () and not result, result
        assert "DPOTrainer has no _compute_loss_liger" in result.note, result.note
        assert "KTOTrainer has no _compute_loss_liger" in result.note, result.note
    finally:
        unpatch_trl()


# --- real TRL trainers, 2 gloo ranks -------------------------------------------------------------------------


def _trl_step(pool: RankPool, trainer: str, variant: str, folder: pathlib.Path) -> dict[str, Any]:
    """One TRL step on every rank; the upstream measurement (every gradient compared across ranks) done here,
    from the gradients each rank returns. Rank 0's row, with every rank's error."""
    results = pool.run(trl_step, trainer, variant, str(folder), timeout=240)
    assert not any(r["stale_ddp_marker"] for r in results), "an earlier task left DDP's forward marker set"
    row = compare_ranks(results)
    if row["errors"] and len(row["errors"]) < len(results):
        pool.close()  # one rank failed, the other timed out in a collective: never reuse that group
    return row


def _row(result: dict[str, Any]) -> str:
    if result["error"]:
        lines = result["error"].strip().splitlines()
        cause = next((line for line in lines if "TensorWrapper" in line), lines[-1])
        return f"{result['trainer']:>3} {result['variant']:<9} crashed: {cause.strip()}"
    return (
        f"{result['trainer']:>3} {result['variant']:<9} {result['differ']}/{result['params']} params differ, "
        f"max abs diff {result['max_diff']:.2e} ({result['seconds']}s)"
    )


@needs_trl
@pytest.mark.skipif(not HAS_LIGER, reason="liger-kernel is not installed")
@pytest.mark.parametrize("trainer", ["dpo", "kto"])
def test_patch_trl_fixes_liger_desync(pool: RankPool, trainer: str, tmp_path: pathlib.Path) -> None:
    before = _trl_step(pool, trainer, "unpatched", tmp_path)
    after = _trl_step(pool, trainer, "patched", tmp_path)
    print(f"\n{_row(before)}\n{_row(after)}")
    assert not after["errors"], after["errors"]
    assert after["wrapper"] == "DistributedDataParallel"
    assert after["differ"] == 0 and after["max_diff"] == 0.0 and after["params"] > 0
    if _defines_liger_loss(trainer):  # the bug as installed, measured: a desync, or the wrapper-passed crash
        assert before["errors"] or before["differ"] == before["params"] > 0, before
        assert any("routed" in path for path in after["liger_paths"]), after["liger_paths"]
    else:  # TRL's own fix: exact unpatched, and patch_trl (its redirection replaced by ours) keeps it exact
        assert not before["errors"] and before["differ"] == 0 and before["max_diff"] == 0.0, before
        assert not any("Trainer" in label for label in after["patch"]), after["patch"]
        if after["redirection"] is not None:  # a trainer that still redirects (1.14) runs ours
            assert after["redirection"] == "wrapperroute.integrations.trl", after["redirection"]


@needs_trl
@pytest.mark.skipif(not HAS_LIGER, reason="liger-kernel is not installed")
def test_naive_dpo_fix(pool: RankPool, tmp_path: pathlib.Path) -> None:
    """Why patch_trl isolates DPO's loss (where DPOTrainer defines _compute_loss_liger): routed through DDP's
    forward with its graph optimizer (what TRL's own redirection does), the compiled torch.func loss fails to
    compile. TRL 1.14 runs no such loss: the same variant (``patch_trl(mode="redirect")``, which there leaves
    DPO alone and only replaces TRL's redirection with ours) is exact."""
    naive = _trl_step(pool, "dpo", "naive", tmp_path)
    print(f"\n{_row(naive)}")
    if _defines_liger_loss("dpo"):
        assert len(naive["errors"]) == 2 and all("TensorWrapper" in error for error in naive["errors"].values())
    else:
        assert not naive["errors"] and naive["differ"] == 0 and naive["params"] > 0, naive


@needs_trl
@pytest.mark.skipif(not HAS_LIGER, reason="liger-kernel is not installed")
@pytest.mark.parametrize("trainer", ["grpo", "gkd", "distill"])
def test_other_liger_trainers_under_ddp(pool: RankPool, trainer: str, tmp_path: pathlib.Path) -> None:
    """GRPO (Liger GRPO loss), GKD and the distillation trainer (Liger JSD): one real step each, as installed
    and patched. Where the installed trainer routes its Liger loss through a redirection of its own (measured on
    TRL 1.12: all three), it is in sync as installed and stays exact with ours in its place; the step trained
    (non-zero gradients), or the comparison would prove nothing."""
    from wrapperroute.check.trl_cells import TRAINERS

    module = importlib.import_module(TRAINERS[trainer][0])
    if getattr(module, TRAINERS[trainer][2], None) is None:
        pytest.skip(f"the installed TRL has no {TRAINERS[trainer][2]}")
    before = _trl_step(pool, trainer, "unpatched", tmp_path)
    after = _trl_step(pool, trainer, "patched", tmp_path)
    print(f"\n{_row(before)}\n{_row(after)}")
    assert not after["errors"], after["errors"]
    assert after["wrapper"] == "DistributedDataParallel"
    assert after["differ"] == 0 and after["max_diff"] == 0.0 and after["nonzero"] > 0, after
    if before["redirection"] is not None:  # the trainer routes its Liger loss itself
        assert not before["errors"] and before["differ"] == 0 and before["nonzero"] > 0, before
        assert after["redirection"] == "wrapperroute.integrations.trl", after["redirection"]
    else:  # no redirection of its own: the bug, measured
        assert before["errors"] or before["differ"] == before["params"] > 0, before
