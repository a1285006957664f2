"""The check's verdicts never pass a non-finite gradient: NaN or inf against the reference, or alike on every
rank, is a difference of inf (Python's ``max(0.0, nan)`` is 0.0: a NaN would vanish from a running maximum)."""

from __future__ import annotations

import math

import torch

from wrapperroute.check.cell import CellResult, abs_diff, is_exact, max_grad_diff
from wrapperroute.check.trl_cells import compare_ranks


def test_a_nan_gradient_is_never_exact() -> None:
    good = {"w": torch.ones(3)}
    bad = {"w": torch.tensor([1.0, math.nan, 1.0])}
    same, nan = max_grad_diff(good, good), max_grad_diff(bad, good)
    assert same == 0.0 and nan == math.inf, f"equal gradients differ by {same}, a NaN gradient by {nan}"
    inf = abs_diff(torch.tensor([math.inf]), torch.tensor([math.inf]))
    assert inf == math.inf, f"inf beside inf differs by {inf}"
    assert max(0.0, math.nan) == 0.0, "the premise: a running maximum drops a NaN"
    cell = CellResult("ddp/fused_ce/routed", 0)
    cell.max_ref_diff = max(cell.max_ref_diff, max_grad_diff(bad, good))
    assert not is_exact(cell), f"a cell with a NaN gradient is exact: {cell}"


def test_trl_rows_with_nan_alike_on_every_rank_differ() -> None:
    nan = {"w": torch.tensor([math.nan, 1.0])}
    ranks = [{"error": None, "grads": dict(nan), "trainer": "dpo"} for _ in range(2)]
    row = compare_ranks(ranks, [{"error": None, "grads": {"w": torch.ones(2)}} for _ in range(2)])
    assert row["differ"] == 1 and row["max_diff"] == math.inf and row["ref_diff"] == math.inf, row


def test_reports_write_strict_json() -> None:
    """A difference of inf (a NaN gradient) reaches the --json reports as "inf": strict JSON has no Infinity."""
    import json

    from wrapperroute.audit.report import strict_json

    row = {"max_ref_diff": math.inf, "losses": [1.5, math.nan], "nested": ({"d": -math.inf},), "label": "x"}
    text = json.dumps(strict_json(row), allow_nan=False)
    expected = {"max_ref_diff": "inf", "losses": [1.5, "nan"], "nested": [{"d": "-inf"}], "label": "x"}
    assert json.loads(text) == expected, f"the strict JSON written: {text}"
