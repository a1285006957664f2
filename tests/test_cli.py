"""The CLI end to end: it spawns its own ranks (issue 6)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wrapperroute", *args], capture_output=True, text=True, timeout=timeout, env=os.environ
    )


def test_check_reduced_matrix_json() -> None:
    done = _cli("check", "--wrappers", "ddp,fsdp2", "--losses", "fused_ce", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    assert report["ok"] is True and report["nproc"] == 2
    cells = {(c["wrapper"], c["routed"]): c for c in report["cells"]}
    assert set(cells) == {("ddp", False), ("ddp", True), ("fsdp2", False), ("fsdp2", True)}
    assert cells[("ddp", True)]["verdict"] == "exact" and cells[("ddp", True)]["differ"] == 0
    assert cells[("ddp", False)]["verdict"] == "desync" and cells[("ddp", False)]["differ"] > 0
    assert cells[("fsdp2", False)]["verdict"] == "crashes"
    assert "[4/4]" in done.stderr  # progress


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
    assert done.returncode == 2
    assert words in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_env_lists_versions() -> None:
    done = _cli("env", timeout=60)
    assert done.returncode == 0 and "torch" in done.stdout and "wrappers" in done.stdout
