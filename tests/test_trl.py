"""TRL integration: ``ForwardRedirection`` against TRL's own class, and ``patch_trl()`` on real TRL
``DPOTrainer``/``KTOTrainer`` with ``use_liger_kernel=True`` on 2 gloo ranks: the bug and the fix, side by side."""

from __future__ import annotations

import functools
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

from wrapperroute.check.cell import REFERENCE_TOLERANCE
from wrapperroute.check.trl_cells import TRAINERS, compare_ranks, trl_step
from wrapperroute.check.trl_layouts import LAYOUTS
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
    assert torch.equal(out, x * 2.0), f"{cls.__name__}: the method's result {out}, not x * 2"
    linear = nn.functional.linear(x, inner.weight, inner.bias)
    assert torch.equal(seen[0], linear), f"{cls.__name__}: inside the method, inner(x) is not the real forward"
    # forward is the real one again
    assert torch.equal(inner(x), linear), f"{cls.__name__}: after the call, inner(x) is not the real forward"


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
    assert events == ["method", "inner", "outer"], f"{cls.__name__}: the hooks ran as {events}"


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
        said = f"the method left as the forward: {leaked_on_error}, a forward attribute left: {leaked_attribute}"
        assert not leaked_on_error and not leaked_attribute, f"ours: {said}"
    else:  # documents TRL's behaviour; if TRL fixes it, drop this branch
        said = f"the method left as the forward: {leaked_on_error}, a forward attribute left: {leaked_attribute}"
        assert leaked_on_error and leaked_attribute, f"TRL's no longer leaks ({said}): drop this branch"


def test_redirection_under_ddp_matches_trl(pool: RankPool) -> None:
    pool.run(rankside_trl.forward_redirection_ddp, False)
    if HAS_TRL:  # TRL's is correct here (same gradients), but leaves an instance forward behind
        pool.run(rankside_trl.forward_redirection_ddp, True)


# --- patch_trl ---------------------------------------------------------------------------------------------


def _fused_loss_modules() -> set[str]:
    """The installed TRL's modules with a Liger path (their source reads ``use_liger_kernel``), read here
    independently of the code under test (a plain text search of the package)."""
    root = pathlib.Path(importlib.util.find_spec("trl").origin).parent  # type: ignore[union-attr,arg-type]
    return {
        ".".join(("trl", *path.relative_to(root).with_suffix("").parts))
        for path in root.rglob("*.py")
        if "use_liger_kernel" in path.read_text(encoding="utf-8", errors="ignore")
    }


@needs_trl
def test_patch_trl_is_idempotent_and_reversible(monkeypatch: pytest.MonkeyPatch) -> None:
    import trl.models.utils as utils

    from wrapperroute.integrations import trl as integration
    from wrapperroute.integrations.trl import fused_loss_trainers, patch_trl, unpatch_trl

    notes: list[str] = []
    trainers = fused_loss_trainers(notes)
    found = {cls.__module__ for cls in trainers}
    outside = found - _fused_loss_modules()
    assert not outside, f"trainers found outside the modules with a Liger path: {outside}"
    # every trainer module the text search finds is patched, or named in the note (some releases ship an
    # experimental trainer that fails to import without an optional package)
    unimported = {note.split(" ", 1)[0] for note in notes if " not imported (" in note}
    assert found | unimported >= {m for m in _fused_loss_modules() if m.endswith("_trainer")}, notes
    owners = {next(c for c in cls.__mro__ if "compute_loss" in vars(c)) for cls in trainers}
    originals = {owner: owner.__dict__["compute_loss"] for owner in owners}
    try:
        first = patch_trl()
        second = patch_trl()
        assert first.patched == second.patched, f"patched twice: {first.patched}, then {second.patched}"
        assert utils._ForwardRedirection is ForwardRedirection, "trl.models.utils keeps TRL's redirection"
        import trl.trainer.grpo_trainer as grpo  # imported after the patch: takes ours from trl.models.utils

        # a GRPO trainer that imports TRL's redirection (not every release does) takes ours
        taken = getattr(grpo, "_ForwardRedirection", ForwardRedirection)
        assert taken is ForwardRedirection, f"the GRPO trainer imported after the patch took {taken}"
        for owner in owners:
            if owner.__module__.startswith("transformers"):
                continue  # the Trainer's own compute_loss is never touched
            assert f"{owner.__module__}.{owner.__qualname__}.compute_loss" in first.patched, first.patched
            assert owner.__dict__["compute_loss"] is not originals[owner], f"{owner.__qualname__} was not patched"
    finally:
        unpatch_trl()
    kept = [owner.__qualname__ for owner, before in originals.items() if owner.__dict__["compute_loss"] is not before]
    assert not kept, f"unpatched, these still hold a patched compute_loss: {kept}"
    assert utils._ForwardRedirection is not ForwardRedirection, "unpatched, trl.models.utils still holds ours"
    back = getattr(grpo, "_ForwardRedirection", utils._ForwardRedirection)
    assert back is utils._ForwardRedirection, f"unpatched, the GRPO trainer still holds {back}"  # back too

    monkeypatch.setattr(integration, "fused_loss_trainers", lambda notes=None: [])  # a TRL with none
    try:
        result = patch_trl(forward_redirection=False)
        # only TRL's fused head installer, where this release has one (TRL 1.16), and every module holding it
        assert all(label.endswith(".add_fused_lm_head") for label in result.patched), result
        assert bool(result) == hasattr(importlib.import_module("trl.trainer.utils"), "add_fused_lm_head"), result
        assert "has no trainer with a fused Liger loss" in result.note, result.note
    finally:
        unpatch_trl()


# --- real TRL trainers, 2 gloo ranks -------------------------------------------------------------------------

needs_liger = pytest.mark.skipif(not HAS_LIGER, reason="liger-kernel is not installed")
# Every trainer under DDP (the desync) and with the head in an FSDP2 unit of its own (a head read outside its
# unit), and three trainers of each kind (preference, on-policy, distillation) under every wrapper, as
# `wrapperroute check --trl` runs them all (a trainer this TRL lacks: skipped).
CELLS = [
    (trainer, layout)
    for trainer in TRAINERS
    for layout in LAYOUTS
    if layout in ("ddp", "fsdp2_head") or trainer in ("dpo", "grpo", "gkd")
]


def _trl_step(pool: RankPool, trainer: str, variant: str, folder: pathlib.Path, layout: str = "ddp",
              reference: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    """One TRL step on every rank; every gradient compared across ranks here, from the gradients each rank
    returns, and with the reference's mean when given. Rank 0's row, with every rank's error."""
    results = pool.run(trl_step, trainer, variant, str(folder), layout, timeout=240)
    assert not any(r.get("stale_ddp_marker") for r in results), "an earlier task left DDP's forward marker set"
    row = compare_ranks(results, reference)
    if row["errors"] and len(row["errors"]) < len(results):
        pool.close()  # one rank failed, the other timed out in a collective: never reuse that group
    return row


@pytest.fixture(scope="module")
def references(pool: RankPool, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Any]:
    """Each trainer's reference (the ``local`` layout: the model unwrapped, each rank alone on its shard), run
    once per module; and the model folder every step shares."""
    folder = tmp_path_factory.mktemp("trl_model")
    made: dict[str, Any] = {}

    def get(trainer: str) -> Any:
        if trainer not in made:
            local = pool.run(trl_step, trainer, "unpatched", str(folder), "local", timeout=240)
            assert not any(r["error"] for r in local), local[0]["error"]
            made[trainer] = local
        return made[trainer], folder

    return get


def _row(result: dict[str, Any]) -> str:
    if result["error"]:
        lines = result["error"].strip().splitlines()
        cause = next((line for line in lines if "TensorWrapper" in line), lines[-1])
        where = f"{result['trainer']:>7} {result.get('layout', 'ddp'):<6} {result['variant']:<9}"
        return f"{where} crashed: {cause.strip()}"
    return (
        f"{result['trainer']:>7} {result.get('layout', 'ddp'):<6} {result['variant']:<9} "
        f"{result['differ']}/{result['params']} params differ, max abs diff {result['max_diff']:.2e}, "
        f"vs reference {result['ref_diff']} ({result['seconds']}s)"
    )


@functools.cache
def _liger_trainers() -> tuple[list[str], list[str]]:
    from wrapperroute.check.trl_report import liger_trainers

    _, found, left = liger_trainers()
    return found, left


def _installed(trainer: str) -> None:
    found, left = _liger_trainers()
    if trainer not in found:  # this TRL lacks the trainer, or its config has no use_liger_kernel
        names = TRAINERS[trainer][1:]  # its config and trainer class, as the report's line names them
        pytest.skip(next((line for line in left if any(f" {name}" in line for name in names)), trainer))


@needs_trl
@needs_liger
@pytest.mark.parametrize(("trainer", "layout"), CELLS, ids=[f"{t}-{w}" for t, w in CELLS])
def test_patched_trainer_exact(pool: RankPool, references: Callable[[str], Any], trainer: str, layout: str) -> None:
    """A real TRL trainer's step under DDP, ZeRO-3 or FSDP2 (accelerate told FSDP on CPU), as installed and
    patched. Patched: every gradient equal across ranks, non-zero, and within 1e-6 of the mean of the ranks'
    gradients computed alone (the reference). As installed, measured beside it: a desync, a crash or a wrong
    gradient, or in sync only where the trainer routes its loss through a redirection of its own."""
    _installed(trainer)
    if layout == "zero3" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    reference, folder = references(trainer)
    before = _trl_step(pool, trainer, "unpatched", folder, layout, reference)
    after = _trl_step(pool, trainer, "patched", folder, layout, reference)
    print(f"\n{_row(before)}\n{_row(after)}")
    assert not after["errors"], after["errors"]
    assert after["differ"] == 0 and after["max_diff"] == 0.0 and after["nonzero"] > 0, after
    assert after["ref_diff"] is not None and after["ref_diff"] <= REFERENCE_TOLERANCE, after
    from wrapperroute.integrations.trl import fused_loss_trainers

    bug = before["errors"] or before["differ"] or (before["ref_diff"] or 0.0) > REFERENCE_TOLERANCE
    has_path = any(cls.__name__ == _class_name(trainer) for cls in fused_loss_trainers())
    if has_path:
        assert any(path.startswith(_class_name(trainer)) for path in after["liger_paths"]), after  # the patch saw it
    if any(path.startswith("add_fused_lm_head: fused head read inside") for path in after["liger_paths"]):
        # TRL's fused head in the model (TRL 1.16): inside the wrapper's forward, so in sync, but a head alone in
        # its FSDP2 unit is read outside that unit's forward: consistent and wrong as installed
        assert not before["errors"] and not before["differ"], before
        assert bug == (layout == "fsdp2_head"), before
        return
    if not has_path or all("no fused Liger loss" in path for path in after["liger_paths"]):
        # this TRL's trainer holds no fused Liger loss (none at all, or its Liger path runs inside the model's own
        # forward, as from TRL 1.14): nothing to fix, exact as installed; except with the head alone in its unit,
        # where a chunked loss of the trainer's own read through TRL's redirection of the root (the distillation
        # trainer on TRL 1.16: 5.9e-5 off) is consistent and wrong, and exact once the redirection is ours
        if layout == "fsdp2_head":
            assert not before["errors"] and not before["differ"], before
        else:
            assert not bug, before
        return
    if layout == "ddp" and trainer in ("dpo", "kto") and _defines_liger_loss(trainer):
        # the upstream bug as installed: a desync, or the wrapper-passed crash
        assert before["errors"] or before["differ"] == before["params"] > 0, before
    # Under DDP, in sync as installed only through a redirection of its own. ZeRO-3 and FSDP2 reduce each gradient
    # from their own hooks whatever ran the forward: a Liger path outside it crashes on sharded weights there, or
    # is in sync (GOLD on TRL 1.0-1.1 under ZeRO-3, a desync under DDP; KTO on 1.0-1.2 under FSDP2).
    assert bug or before["redirection"] is not None or layout != "ddp", before


def _class_name(trainer: str) -> str:
    return TRAINERS[trainer][2]


@needs_trl
@needs_liger
def test_naive_dpo_fix(pool: RankPool, tmp_path: pathlib.Path) -> None:
    """Why patch_trl isolates DPO's loss (where DPOTrainer defines _compute_loss_liger): routed through DDP's
    forward with its graph optimizer (what TRL's own redirection does), the compiled torch.func loss fails to
    compile. TRL 1.14 runs no such loss: the same variant (``patch_trl(mode="redirect")``) is exact there."""
    naive = _trl_step(pool, "dpo", "naive", tmp_path)
    print(f"\n{_row(naive)}")
    if _defines_liger_loss("dpo"):
        errors = naive["errors"]
        assert len(errors) == 2 and all("TensorWrapper" in e for e in errors.values()), f"the naive fix: {errors}"
    else:
        assert not naive["errors"] and naive["differ"] == 0 and naive["params"] > 0, naive


@needs_trl
@needs_liger
def test_moe_load_balancing_term_never_dropped_silently(pool: RankPool) -> None:
    """The distillation trainer's loss reads the backbone's hidden states: on an MoE model whose config asks for
    router logits, the model's own forward adds a load-balancing term (non-zero here) that the installed trainer
    never adds. Patched, it says so once, naming the trainer and the coefficient; on the same model without router
    logits it says nothing."""
    asked = pool.run(rankside_trl.moe_distillation_step, True, timeout=240)
    quiet = pool.run(rankside_trl.moe_distillation_step, False, timeout=240)
    for result in asked:
        assert result["wrapper"] == "DistributedDataParallel" and result["aux"] > 0.1, result
        assert len(result["warnings"]) == 1, result["warnings"]
        said = result["warnings"][0]
        assert "DistillationTrainer" in said and "load-balancing" in said and "router_aux_loss_coef=" in said, said
    for result in quiet:
        assert result["warnings"] == [], result["warnings"]
