"""The audit in the states a real job passes through: two independent data-parallel groups on 4 ranks, NaN on
one rank or on every rank, and a Python environment holding torch and wrapperroute only (no numpy)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CACHE, REPO
from test_audit import ENV, SCRIPTS, _audit, _one_final, _run, _torchrun


@pytest.mark.parametrize("setup", ["ddp_groups", "replicate_mesh"])
def test_two_groups_each_compared_within_itself(setup: str) -> None:
    """4 ranks, two groups each training its own model: in sync, exit 0 (compared across the whole world, the
    two models would differ everywhere); the upstream bug in one group (DDP's groups): DESYNC, exit 3."""
    wrapper = "ddp" if setup == "ddp_groups" else "replicate"
    good = _audit(4, "groups.py", "--setup", setup, audit=("--steps", "all"))
    final = _one_final(good)
    assert final.startswith("wrapperroute audit: in sync (3 step(s)") and f"wrappers: {wrapper})" in final, final
    assert good["code"] == 0, good["err"][-3000:]
    if setup != "ddp_groups":
        return  # a desync within one group is found by the same comparison whichever groups the wrappers name
    bad = _audit(4, "groups.py", "--setup", setup, "--bug")
    final = _one_final(bad)
    assert final.startswith("wrapperroute audit: DESYNC") and f"{wrapper}[0].lm_head.weight (gradient)" in final, final
    assert 3 in bad["rank_codes"], bad["err"][-3000:]


def test_nan_on_one_rank_is_a_desync_nan_everywhere_is_not(tmp_path: Path) -> None:
    """The upstream bug with rank 1's loss NaN: its gradients NaN beside rank 0's numbers, DESYNC, exit 3.
    Routed, the same NaN reaches every rank through DDP's all-reduce: alike everywhere, in sync, exit 0, and
    said to be non-finite in the final line and the JSON."""
    bad = _audit(2, "ddp_train.py", "--loss", "module", "--nan", "rank1")
    final = _one_final(bad)
    assert final.startswith("wrapperroute audit: DESYNC") and "worst NaN or inf beside other values" in final, final
    assert 3 in bad["rank_codes"], bad["err"][-2000:]
    assert "nan/inf x" in bad["out"], bad["out"]  # the table says which values differ
    report = tmp_path / "audit.json"
    good = _audit(2, "ddp_train.py", "--loss", "routed", "--nan", "rank1", audit=("--json", str(report)))
    final = _one_final(good)
    assert final.startswith("wrapperroute audit: in sync") and "NaN or inf alike on every rank" in final, final
    assert good["code"] == 0, good["err"][-2000:]
    written = json.loads(report.read_text())
    assert written["verdict"] == "in sync" and any(c["nonfinite"] for c in written["checkpoints"]), written


def _bare_venv() -> Path:
    """A virtual environment holding torch, what torch requires, and wrapperroute, nothing else: the user who ran
    ``pip install torch wrapperroute``. Torch's installed distributions are linked into it, not unpacked again (its
    wheel took 22 s to install), and wrapperroute's folder is on its path as an editable install puts it. Made once,
    kept in the suite's cache."""
    release = torch.__version__.split("+")[0]
    venv = CACHE / f"venv-bare-linked-torch{release}-py{sys.version_info.major}{sys.version_info.minor}"
    python = venv / "bin" / "python"
    if not (venv / "ready").exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(venv)], check=True)
        where = "import sysconfig; print(sysconfig.get_path('purelib'))"
        found = subprocess.run([str(python), "-c", where], capture_output=True, text=True, check=True)
        site = Path(found.stdout.strip())
        for name in _required("torch"):
            distribution = importlib.metadata.distribution(name)
            for top in {path.parts[0] for path in distribution.files or ()} - {"..", "__pycache__"}:
                (site / top).symlink_to(Path(str(distribution.locate_file(top))))
        (site / "wrapperroute.pth").write_text(f"{REPO}\n")
        (venv / "ready").touch()
    return python


def _required(name: str) -> set[str]:
    """``name`` and every distribution it requires, transitively, as pip installs them here (markers evaluated,
    no extras)."""
    from packaging.requirements import Requirement

    found: set[str] = set()
    pending = [name]
    while pending:
        current = pending.pop()
        key = current.lower().replace("_", "-")
        if key in found:
            continue
        found.add(key)
        for line in importlib.metadata.requires(current) or ():
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append(requirement.name)
    return found


def _verdicts(python: str) -> dict[str, Any]:
    found = {}
    # a NaN beside numbers: DESYNC through the same comparison a plain desync takes, and the NaN-aware part too
    for name, args in (("in sync", ("--loss", "routed")), ("nan", ("--loss", "module", "--nan", "rank1"))):
        command = [python, *_torchrun(2, "-m", "wrapperroute", "audit", str(SCRIPTS / "ddp_train.py"), *args)[1:]]
        run = _run(command)
        found[name] = (_one_final(run).split(" (")[0], 3 in run["rank_codes"] or run["code"] == 0)
    return found


def test_the_audit_needs_nothing_torch_does_not_bring() -> None:
    """In a venv with torch and wrapperroute only, every verdict and status is the one a full environment gives.
    The premise: torch's own object collectives (which the audit used) fail there."""
    python = str(_bare_venv())
    probe = ("import torch.distributed as dist, tempfile, os; d = tempfile.mkdtemp();"
             "dist.init_process_group('gloo', store=dist.FileStore(os.path.join(d, 's'), 1), rank=0, world_size=1);"
             "out = [None]; dist.all_gather_object(out, {'a': 1})")  # fmt: skip
    premise = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120, env=ENV)
    assert premise.returncode != 0 and "Numpy is not available" in premise.stderr, premise.stderr[-2000:]
    bare = _verdicts(python)  # the same runs in this environment: above, and tests/test_audit.py
    assert bare["nan"][0] == "wrapperroute audit: DESYNC", bare
    assert bare["in sync"][0] == "wrapperroute audit: in sync", bare
    assert all(status for _, status in bare.values()), bare  # 3 on a desync, 0 in sync


def test_an_audit_failure_is_the_audits_not_the_scripts(tmp_path: Path) -> None:
    """The audit's own error (here: comparisons made impossible by a broken signature function) never ends
    the script: it runs to the end, the final line says FAILED with the true reason, exit status 4."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        "import wrapperroute.crossrank as c\n"
        "def broken(rows):\n    raise RuntimeError('signatures broke')\n"
        "c.signatures = broken\n"
    )
    env = {**ENV, "PYTHONPATH": f"{shim}{os.pathsep}{ENV['PYTHONPATH']}"}
    command = _torchrun(2, "-m", "wrapperroute", "audit", str(SCRIPTS / "ddp_train.py"), "--loss", "routed")
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    finals = [line for line in done.stdout.splitlines() if line.startswith("wrapperroute audit: FAILED")]
    assert finals and "RuntimeError: signatures broke" in finals[0], done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count("step 3 loss") == 2, done.stdout  # the script ran to its end on both ranks
    assert "exitcode  : 4" in done.stderr or "exitcode: 4" in done.stderr.replace(" ", ""), done.stderr[-2000:]


def test_a_desync_only_the_end_comparison_sees(tmp_path: Path) -> None:
    """Audited steps in sync, the desync after them: when the script destroys its process group at the end, the
    final comparison reports it, with its final line, --json and status 3, under --on-desync exit and raise
    alike; when it does not (its models freed before the audit's end), the final line says no final comparison
    ran, and how to have one."""
    missed = _audit(2, "ddp_train.py", "--module-from", "2", "--steps", "4", audit=("--steps", "1"))
    assert "no final comparison" in _one_final(missed) and missed["code"] == 0, missed["out"][-2000:]
    for on_desync in ("exit", "raise"):
        report = tmp_path / f"{on_desync}.json"
        run = _audit(2, "ddp_train.py", "--module-from", "2", "--steps", "4", "--destroy",
                     audit=("--steps", "1", "--on-desync", on_desync, "--json", str(report)))  # fmt: skip
        final = _one_final(run)
        assert final.startswith("wrapperroute audit: DESYNC") and "first at end" in final, (on_desync, final)
        assert run["code"] != 0 and 3 in run["rank_codes"], (on_desync, run["err"][-2000:])
        written = json.loads(report.read_text())
        assert written["verdict"] == "desync" and written["exit_status"] == 3, written


def test_a_sweep_is_audited_afresh_after_the_group_is_made_again(tmp_path: Path) -> None:
    """Two runs in one process: the first routed (in sync), the second with the bug. The second run's first
    step is its own "step 1", audited and found."""
    report = tmp_path / "sweep.json"
    run = _audit(2, "sweep.py", audit=("--json", str(report)))
    written = json.loads(report.read_text())
    labels = [(c["label"], bool(c["differences"])) for c in written["checkpoints"]]
    # each run compares its parameters once before its first step, then audits its own steps from 1
    assert labels[:3] == [("before step 1", False), ("step 1", False), ("step 2", False)], labels
    assert labels[3:5] == [("before step 1", False), ("step 1", True)], labels
    assert _one_final(run).startswith("wrapperroute audit: DESYNC") and 3 in run["rank_codes"], run["out"][-2000:]


def test_a_grad_sync_error_of_the_scripts_own_is_its_failure() -> None:
    """A ``GradSyncError`` the script raises itself (``wrapperroute.guard``) is the script's failure (status 1,
    said so), not a desync the audit found (status 3)."""
    run = _audit(2, "small.py", "--case", "guard")
    final = _one_final(run)
    assert "the script failed: GradSyncError: the script's own guard" in final, final
    assert 3 not in run["rank_codes"] and 1 in run["rank_codes"], run["err"][-2000:]


@pytest.mark.parametrize(("sync", "verdict", "words"), [
    ("none", "DESYNC", "fsdp2[0].down.weight (gradient)"),
    ("hand", "in sync", "up to 4 tensors compared per step"),
    ("shard", "in sync", "2 sharded gradient(s) per step came only through their wrapper's reduction"),
])  # fmt: skip
def test_an_adapter_added_after_fully_shard(sync: str, verdict: str, words: str) -> None:
    """A low-rank adapter beside a frozen FSDP2-sharded base (transformers PR #48792): whole on every rank, so
    compared there. As written each rank trains its own: DESYNC, 3. Averaged by hand: in sync, 0, the adapter
    compared. Sharded too: nothing to compare, and every sharded gradient checked to come through FSDP2's
    reduce-scatter: in sync, 0."""
    run = _audit(2, "adapters.py", "--sync", sync)
    final = _one_final(run)
    assert final.startswith(f"wrapperroute audit: {verdict}") and words in final, final
    assert (3 in run["rank_codes"]) if verdict == "DESYNC" else run["code"] == 0, run["err"][-2000:]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_experts_are_compared_within_their_group() -> None:
    """DeepSpeed MoE, ep_size 2 on 2 ranks: each rank's experts are its own (an expert group of one), the dense
    layers replicas. In sync, 0, the experts said not compared; a dense weight changed on one rank: DESYNC, 3.
    (ZeRO-2 steps its inner optimizer once per parameter group, the model half updated in between: audited once
    per engine step.)"""
    good = _audit(2, "moe.py", audit=("--steps", "all"))
    final = _one_final(good)
    assert final.startswith("wrapperroute audit: in sync (3 step(s)") and "4 expert group of one" in final, final
    assert good["code"] == 0, good["err"][-2000:]
    bad = _audit(2, "moe.py", "--bug")
    final = _one_final(bad)
    assert final.startswith("wrapperroute audit: DESYNC") and "deepspeed[0].dense.weight (parameter)" in final, final
    assert 3 in bad["rank_codes"], bad["err"][-2000:]


def test_dtensor_experts_on_an_ep_mesh() -> None:
    """torchtitan's layout on 4 ranks: experts sharded over ep, replicated over dp; dense layers HSDP. In sync:
    every copy agrees (the experts compared over dp only); rank 1's dense gradients scaled: DESYNC, 3."""
    good = _audit(4, "experts.py", audit=("--steps", "all"))
    final = _one_final(good)
    assert final.startswith("wrapperroute audit: in sync (3 step(s) audited, up to 10 tensors"), final
    assert good["code"] == 0, good["err"][-2000:]
    bad = _audit(4, "experts.py", "--bug")
    final = _one_final(bad)
    assert final.startswith("wrapperroute audit: DESYNC") and "fsdp2[0].dense." in final, final
    assert 3 in bad["rank_codes"], bad["err"][-2000:]


def test_a_parameter_nan_on_one_rank_before_the_first_step() -> None:
    """NaN written into one of rank 1's parameters after wrapping: through the all-reduce every rank's gradients,
    then parameters, become NaN alike, which a comparison after the step would call in sync. The parameters
    compared once before the first step: DESYNC, 3."""
    run = _audit(2, "ddp_train.py", "--loss", "routed", "--nan", "param")
    final = _one_final(run)
    assert final.startswith("wrapperroute audit: DESYNC") and "first before step 1" in final, final
    assert "ddp[0].blocks.0.proj.weight (parameter)" in final and 3 in run["rank_codes"], final


@pytest.mark.parametrize(("nproc", "layout", "verdict", "words"), [
    (2, "head_unit", "BYPASSED", "first at step 1: fsdp2[0].lm_head.weight (autograd through the sharded parameter"),
    (2, "root", "in sync", "up to 6 sharded gradient(s) per step came only through their wrapper's reduction, "
                           "checked at step(s) 1-3"),
    (4, "tp_dp", "in sync", "checked at step(s) 1-3"),
])  # fmt: skip
def test_every_parameter_sharded(tmp_path: Path, nproc: int, layout: str, verdict: str, words: str) -> None:
    """No copy to compare anywhere: how each sharded gradient arrived is what the audit checks. TRL's fused head
    in miniature on a head in its own FSDP2 unit: BYPASSED, naming the head, 3 on every rank (the gradient is
    0.133 off one process: tests/test_sharded.py). The head in the root's group: in sync, 0, every gradient
    counted. dp2 x tp2 with the vocabulary-parallel head: in sync, 0 (FSDP's pieces of the 2-D sharded head are
    told apart from copies: it was a DESYNC before)."""
    report = tmp_path / "audit.json"
    run = _audit(nproc, "sharded.py", "--layout", layout, audit=("--json", str(report)))
    final = _one_final(run)
    assert final.startswith(f"wrapperroute audit: {verdict}") and words in final, final
    written = json.loads(report.read_text())
    if verdict == "BYPASSED":
        assert written["verdict"] == "bypassed" and written["exit_status"] == 3, written
        assert written["checkpoints"][0]["bypassed"][0]["key"] == "fsdp2[0].lm_head.weight", written
        # torchrun names each rank's status (and the first again, in its log line)
        assert set(run["rank_codes"]) == {3} and len(run["rank_codes"]) > nproc, run["err"][-2000:]
        assert "bypassed their wrapper's reduction" in run["out"], run["out"][-2000:]  # the step's table
    else:
        assert written["verdict"] == "in sync" and run["code"] == 0, run["err"][-2000:]
        assert all(c["sharded_verified"] > 0 for c in written["checkpoints"]), written


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is not installed")
def test_trls_fused_head_on_a_head_in_its_own_unit() -> None:
    """TRL's own fused head (TRL >= 1.16) on a tiny Llama, the head in its own FSDP2 unit: BYPASSED naming the head,
    3 on every rank; under patch_trl(), and with the head in the root's group as installed: in sync, 0, every
    sharded gradient counted."""
    from trl.trainer import utils

    if not hasattr(utils, "add_fused_lm_head"):
        pytest.skip("the installed TRL has no add_fused_lm_head (TRL >= 1.16 has)")
    bad = _audit(2, "sharded.py", "--model", "trl", "--layout", "head_unit")
    final = _one_final(bad)
    assert final.startswith("wrapperroute audit: BYPASSED") and "first at step 1: fsdp2[0].lm_head.weight" in final, (
        final)  # fmt: skip
    assert set(bad["rank_codes"]) == {3} and len(bad["rank_codes"]) > 2, bad["err"][-2000:]
    for args in (("--layout", "head_unit", "--patch"), ("--layout", "root")):
        good = _audit(2, "sharded.py", "--model", "trl", *args)
        final = _one_final(good)
        assert final.startswith("wrapperroute audit: in sync") and "up to 21 sharded gradient(s) per step" in final, (
            final)  # fmt: skip
        assert good["code"] == 0, good["err"][-2000:]


@pytest.mark.parametrize(("layout", "bug", "verdict", "words"), [
    ("pp2_ddp", None, "in sync", "up to 6 tensors compared per step"),
    ("pp2_ddp", "scale", "DESYNC", "ddp[0].blocks.0.proj.weight (gradient)"),
    ("pp2_fsdp2", None, "in sync", "up to 3 sharded gradient(s) per step came only through"),
    ("pp2_fsdp2", "full_tensor", "BYPASSED", "first at step 1: fsdp2[0].lm_head.weight"),
])  # fmt: skip
def test_a_pipeline_with_data_parallel_stages(layout: str, bug: str | None, verdict: str, words: str) -> None:
    """pp2 x dp2 on 4 ranks, 1F1B, PipelineLoss on the last stage: each stage's replicas compared within its own
    data-parallel group (DDP), or each stage's shards checked for how their gradients arrived (FSDP2). A replica of
    stage 0 scaled by hand on one rank: DESYNC, 3; the FSDP2 head read whole around its unit: BYPASSED, 3."""
    run = _audit(4, "pipeline.py", "--layout", layout, *(("--bug", bug) if bug else ()))
    final = _one_final(run)
    assert final.startswith(f"wrapperroute audit: {verdict}") and words in final, final
    if bug is None:
        assert run["code"] == 0, run["err"][-2000:]
    else:
        assert set(run["rank_codes"]) == {3} and len(run["rank_codes"]) > 4, run["err"][-2000:]
