"""crossrank's signatures on one process: each tensor's L2 norm in its own precision, float32 at least (half and
bfloat16 accumulated in float32), integers exact in float64, an absent tensor NaN; the same whatever the mix."""

from __future__ import annotations

import math

import torch

from wrapperroute.crossrank import Row, signatures


def test_signatures_by_dtype() -> None:
    generator = torch.Generator().manual_seed(0)
    tensors = [
        torch.randn(300, generator=generator).bfloat16(),
        torch.randn(7, generator=generator).half(),
        torch.randn(11, generator=generator),
        torch.randn(5, generator=generator, dtype=torch.float64),
        torch.arange(9),
        None,
    ]
    rows = [Row(f"t{i}", t, (0,)) for i, t in enumerate(tensors)]
    got = signatures(rows)
    expected = [float(t.float().norm()) for t in tensors[:3]] + [float(tensors[3].norm())]  # type: ignore[union-attr]
    expected.append(float(tensors[4].double().norm()))  # type: ignore[union-attr]
    assert got[:5] == expected and math.isnan(got[5]), (got, expected)
    reordered = signatures(rows[::-1])[::-1]
    assert reordered[:5] == expected, f"grouped otherwise, the signatures {reordered} differ from {expected}"
