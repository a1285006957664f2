"""The benchmark harness runs (a smoke run, no timing asserted: figures live in benchmarks/results/)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import rankside_benchmarks

from wrapperroute.ranks import RankPool

BENCH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def test_quick_benchmark_runs(tmp_path: pathlib.Path) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / "run.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "quick.json").read_text())
    tiny = results["ddp_step"]["tiny"]
    assert tiny["ratio"] > 0 and tiny["reps"] == 5, f"the tiny DDP step's row: {tiny}"
    overhead = results["overhead_no_wrapper"]
    assert overhead["overhead_us"] > 0, f"the overhead without a wrapper: {overhead}"
    allocated = results["allocated"]
    # the harness counted something
    assert "error" in allocated or allocated["forward_native_mib"] > 0, f"the allocation row: {allocated}"
    runs = results["peak_rss"]["runs"]["routed"]
    assert len(runs) == 1, f"{len(runs)} routed peak-RSS runs, not 1 (--quick): {runs}"
    assert "routed / native DDP step" in done.stdout, f"the table is missing its row: {done.stdout[-3000:]}"
    call = results["ddp_call_overhead"]["1e6"]
    if "trl_us" in call:  # TRL installed: the decomposition row is measured too
        assert call["bare_us"] > 0 and "bare swap" in done.stdout, f"the bare swap is not measured: {call}"


def test_token_cost_measures_on_the_ranks(pool: RankPool) -> None:
    """benchmarks/token_cost.py's measurement, as ``--quick`` runs it, in the suite's pool (its own pool and
    process cost more than the measurement)."""
    for micro_batches in (2, 1):  # a step of two micro-batches (accumulation) and of one, each with its ratios
        row = pool.run(rankside_benchmarks.token_cost_row, micro_batches)[0]
        assert row["ratio"] > 0 and row["over_bare"]["ratio"] > 0, row
        line = row["line"]
        assert line.startswith(f"{micro_batches} micro-batch(es)"), line
        for phrase in ("step over token_divisor / over the rank's own count", "token_divisor / the bare all-reduce"):
            assert phrase in line, f"{phrase!r} missing: {line}"


def test_instruction_count_workers_run() -> None:
    """benchmarks/instructions.py counts under valgrind (10 minutes: not here); its two workers must run."""
    paths = ["ours"] + (["trl"] if importlib.util.find_spec("trl") is not None else [])
    for path in paths:
        done = subprocess.run(
            [sys.executable, str(BENCH / "instructions.py"), "--worker", path, "3", "--bytecodes"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0 and f"{path}: 3 calls" in done.stdout, (path, done.stderr[-3000:])
        found = re.search(r"bytecodes: (\d+)", done.stdout)
        assert found is not None and int(found.group(1)) > 100, done.stdout  # DDP's forward alone is hundreds
