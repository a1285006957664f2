"""Rank bodies for tests/test_benchmarks.py: a benchmark's measurement run in the suite's pool."""

from __future__ import annotations

import importlib
import sys
from typing import Any

from conftest import REPO


def token_cost_row(micro_batches: int) -> dict[str, Any]:
    """benchmarks/token_cost.py's measurement, tiny model, 5 repetitions, and the line it prints for it."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    token_cost = importlib.import_module("token_cost")
    row: dict[str, Any] = token_cost.token_divisor_ratio("tiny", 5, micro_batches)
    return {**row, "line": token_cost._line(row)}
