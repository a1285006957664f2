"""The CLI end to end: it spawns its own ranks."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wrapperroute", *args], capture_output=True, text=True, timeout=timeout, env=os.environ
    )


def test_check_reduced_matrix_json() -> None:
    """The JSON report, and a quiet stderr: only progress lines (DeepSpeed's log lines and torch's deprecation
    warnings from the ranks are silenced by default)."""
    has_deepspeed = importlib.util.find_spec("deepspeed") is not None
    wrappers = "ddp,fsdp2,pp2_1f1b" + (",zero2" if has_deepspeed else "")
    done = _cli("check", "--wrappers", wrappers, "--losses", "fused_ce", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["ok"] is True and report["nproc"] == 2, f"ok {report['ok']}, nproc {report['nproc']}"
    cells = {(c["wrapper"], c["routed"]): c for c in report["cells"] if c["wrapper"] != "zero2"}
    expected = {("ddp", False), ("ddp", True), ("fsdp2", False), ("fsdp2", True), ("ddp", "rank mean"),
                ("pp2_1f1b", False), ("pp2_1f1b", True), ("pp2_1f1b", "scaled")}  # fmt: skip
    assert set(cells) == expected, f"the cells reported: {sorted(cells, key=str)}"
    routed, unrouted = cells[("ddp", True)], cells[("ddp", False)]
    assert routed["verdict"] == "exact" and routed["differ"] == 0, f"DDP routed: {routed}"
    assert unrouted["verdict"] == "desync" and unrouted["differ"] > 0, f"DDP unrouted: {unrouted}"
    assert cells[("fsdp2", False)]["verdict"] == "crashes", f"FSDP2 unrouted: {cells[('fsdp2', False)]}"
    # each rank's own mean on the same uneven batches: shown, off the global token mean, not a failure
    own_mean = cells[("ddp", "rank mean")]
    assert own_mean["verdict"] == "off: what token_divisor fixes" and own_mean["max_ref_diff"] > 1e-3, own_mean
    # a pipeline: routed exact, the bare loss on plain stages exact too (no wrapper to miss), and the schedule's
    # scaling of each micro-batch's own mean off one process
    assert cells[("pp2_1f1b", True)]["verdict"] == "exact", cells[("pp2_1f1b", True)]
    assert cells[("pp2_1f1b", False)]["verdict"] == "in sync", cells[("pp2_1f1b", False)]
    scaled = cells[("pp2_1f1b", "scaled")]
    assert scaled["verdict"] == "off: what PipelineLoss fixes" and scaled["max_ref_diff"] > 1e-3, scaled
    total = 10 if has_deepspeed else 8
    assert f"[{total}/{total}]" in done.stderr, f"no progress line [{total}/{total}]: {done.stderr[-2000:]}"
    # the check's own notices about C++ build locks another run left in the shared cache are said, not noise
    ours = r"\[\d+/\d+\] |wrapperroute: (removed a stale C\+\+ extension build lock|waiting for )"
    noise = [line for line in done.stderr.splitlines() if line.strip() and not re.match(ours, line)]
    assert noise == [], noise


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("check", "--wrappers", "horovod"), "unknown wrapper 'horovod'"),
        (("check", "--losses", "mse"), "unknown loss 'mse'"),
        (("check", "--nproc", "0"), "--nproc must be at least 2"),
    ],
)
def test_bad_input_one_line(args: tuple[str, ...], words: str) -> None:
    done = _cli(*args, timeout=60)
    assert done.returncode == 2, f"{args}: exit status {done.returncode}, not the usage error's 2"
    assert words in done.stderr, f"{args}: the error does not say {words!r}: {done.stderr}"
    one_line = "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert one_line, f"{args}: not one line: {done.stderr}"


def test_env_lists_versions() -> None:
    done = _cli("env", timeout=60)
    assert done.returncode == 0, f"env exited {done.returncode}: {done.stderr[-2000:]}"
    assert "torch" in done.stdout and "wrappers" in done.stdout, f"env lists no versions or wrappers: {done.stdout}"


def test_cell_that_fails_outside_its_own_try_shows_the_ranks_exception() -> None:
    # A cell whose build raised on the ranks (seen: torch 2.4 has no torch.distributed.tensor.DTensor) reached
    # the table as "run_cell failed on rank(s) [0, 1]:", hiding the cause. The row now carries the exception.
    from wrapperroute.cli import _failed_row, format_table
    from wrapperroute.ranks import RankFailure

    trace = (
        'Traceback (most recent call last):\n  File "wrap_fsdp.py", line 67, in build_fsdp2\n'
        "ImportError: cannot import name 'DTensor' from 'torch.distributed.tensor'\n"
    )
    failure = RankFailure(f"run_cell failed on rank(s) [0, 1]:\n--- rank 0:\n{trace}", {0: trace, 1: trace})
    row = _failed_row("fsdp2", "fused_ce", True, failure)
    assert row["verdict"] == "FAIL" and row["error"].startswith("ImportError: cannot import name 'DTensor'"), row
    assert "ImportError" in format_table([row]), f"the table hides the exception: {format_table([row])}"
    hung = RankFailure("run_cell failed on rank(s) [1]", {1: "no answer within 300s"})
    hung_row = _failed_row("ddp", "fused_ce", False, hung)
    assert hung_row["verdict"] == "crashes" and hung_row["error"] == "no answer within 300s", hung_row


def test_defaults_this_torch_cannot_check_are_named_not_dropped() -> None:
    # FSDP2 on CPU ranks fails or gives wrong gradients natively before torch 2.9 (see WRAPPERS["fsdp2"]):
    # `check` leaves such a default out and says why; asked for by name, it is a usage error with the reason.
    import torch

    from wrapperroute.check.wrappers import WRAPPERS, WrapperCase
    from wrapperroute.cli import UsageError, _names, _skipped

    future = WrapperCase("future", "wrapperroute.check.wrappers:build_ddp", cpu_torch=((99, 0), "not yet"))
    known = {"ddp": WRAPPERS["ddp"], "future": future}
    names = _names(None, known, ("ddp", "future"), "wrapper", 2)
    assert names == ["ddp"], f"the defaults checked: {names}"
    skipped = _skipped(known, ("ddp", "future"), "wrapper", 2)
    assert skipped == [
        f"wrapperroute: skipping wrapper 'future': it needs torch >= 99.0 on CPU ranks, this is {torch.__version__}: "
        "not yet"
    ], f"what is said of the default left out: {skipped}"
    with pytest.raises(UsageError, match=r"wrapper 'future' needs torch >= 99\.0 on CPU ranks.*not yet"):
        _names("ddp,future", known, ("ddp",), "wrapper", 2)


def test_four_rank_layouts_said_when_left_out() -> None:
    """With 2 ranks, the layouts that need 4 are named on stderr with the flag that runs them."""
    done = _cli("check", "--wrappers", "hsdp", timeout=60)
    assert done.returncode == 2 and "needs at least 4 ranks (--nproc 4)" in done.stderr, done.stderr


def test_trl_verdict_needs_a_gradient_and_the_reference() -> None:
    """A TRL step that produced no gradient is in sync trivially, and ranks can agree on a wrong gradient: a
    patched cell is exact only with non-zero gradients equal across ranks and within 1e-6 of the reference."""
    from wrapperroute.check.trl_report import trl_verdict

    row = {"variant": "patched", "error": None, "differ": 0, "max_diff": 0.0, "nonzero": 12, "ref_diff": 3e-8}
    cases = [
        (row, "exact"),
        ({**row, "nonzero": 0}, "no gradient"),
        ({**row, "ref_diff": 2e-3}, "FAIL"),
        ({**row, "ref_diff": None}, "no reference"),
        ({**row, "variant": "unpatched", "ref_diff": 2e-3}, "wrong"),
        ({**row, "variant": "unpatched", "differ": 3, "max_diff": 0.1}, "desync"),
        ({**row, "error": "Traceback ..."}, "FAIL"),
    ]
    for case, expected in cases:
        verdict = trl_verdict(case)
        assert verdict == expected, f"{case}: verdict {verdict!r}, not {expected!r}"


@pytest.mark.skipif(
    not all(importlib.util.find_spec(name) for name in ("trl", "liger_kernel", "datasets")),
    reason="trl, liger-kernel and datasets are not installed",
)
def test_check_trl_prints_the_table_and_exits_0() -> None:
    """On the installed TRL: the table, the reference column, and exit 0 when every patched cell is exact."""
    done = _cli("check", "--trl", "--trainers", "dpo", "--wrappers", "ddp")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("dpo ")]
    assert [row[:3] for row in rows] == [["dpo", "DDP", "unpatched"], ["dpo", "DDP", "patched"]], done.stdout
    assert rows[1][-1] == "exact" and "every patched cell exact" in done.stdout, done.stdout


def test_check_trl_without_trl_or_liger_path_says_so(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No TRL: a one-line usage error (exit 2). A TRL with no trainer that has a Liger path: one line, exit 0."""
    from wrapperroute.check import trl_report
    from wrapperroute.cli import main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else find_spec(name, *a))
    code = main(["check", "--trl"])
    assert code == 2, f"check --trl without TRL: exit status {code}, not the usage error's 2"
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "wrapperroute: error: --trl checks the installed TRL, and TRL is not installed (pip install wrapperroute[trl])"
    ], err
    present = ("trl", "liger_kernel", "datasets")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name in present else None)
    gone = "wrapperroute: TRL 0.0.1 has no DPOTrainer: not checked"
    monkeypatch.setattr(trl_report, "liger_trainers", lambda: ("0.0.1", [], [gone]))
    code = main(["check", "--trl", "--wrappers", "ddp"])
    assert code == 0, f"check --trl with nothing to check: exit status {code}"
    out, err = capsys.readouterr()
    assert out.strip() == (
        "wrapperroute check --trl: TRL 0.0.1 has no trainer with a Liger path to check: nothing checked"
    ), out
    assert err.strip() == gone, f"what is said of the trainer TRL lacks: {err}"
