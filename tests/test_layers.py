"""detect() and route_loss(model, None, fn) see through torch.compile, DDP and PEFT in practical orders."""

from __future__ import annotations

import pytest

pytest.importorskip("peft", reason="PEFT is optional: pip install wrapperroute[peft]")

import rankside_layers

from wrapperroute.ranks import RankPool


@pytest.mark.parametrize(
    ("order", "chain"),
    [
        ("peft,ddp,compile", ("compile", "ddp", "peft", "module")),  # compile(DDP(peft(model)))
        ("peft,compile,ddp", ("ddp", "compile", "peft", "module")),  # DDP(compile(peft(model)))
        ("compile,peft,ddp", ("ddp", "peft", "compile", "module")),  # DDP(peft(compile(model)))
    ],
)
def test_layers_detected_and_routed(pool: RankPool, order: str, chain: tuple[str, ...]) -> None:
    pool.run(rankside_layers.layered_route, order, chain)


def test_layers_unrouted_differs(pool: RankPool) -> None:
    pool.run(rankside_layers.layered_unrouted_differs, "peft,ddp,compile")
