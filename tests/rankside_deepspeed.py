"""Rank bodies for tests/test_deepspeed.py (module level: the pool pickles them by reference). Each runs on
every rank of the pool and returns plain data for the test to assert on."""

from __future__ import annotations

import functools
import time
from typing import Any
from unittest import mock

import torch
from torch import nn

from wrapperroute import detect, route_loss
from wrapperroute.check import cell as cell_module
from wrapperroute.check.cell import Cell, CellResult, run_cell
from wrapperroute.check.models import TinyConfig, build_model


def run_cell_gathering(cell: Cell) -> CellResult:
    """``run_cell`` with ``gather=[unwrapped.lm_head]`` passed to every route_loss call."""

    def gathering(model: nn.Module, unwrapped: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return route_loss(model, unwrapped, fn, *args, gather=[unwrapped.lm_head], **kwargs)

    with mock.patch.object(cell_module, "route_loss", gathering):
        return run_cell(cell)


def time_zero3_gathering(steps: int, gather: bool) -> float:
    """Seconds per routed fused-CE step under ZeRO-3 (persistence 0, vocab 8192 so the head is sizeable)."""
    from wrapperroute.check.losses import LOSSES, make_batch
    from wrapperroute.check.wrap_deepspeed import build_zero

    config = TinyConfig(vocab=8192, hidden=256, layers=1)
    wrapped = build_zero(build_model(config), {"stage": 3, "zero": {"stage3_param_persistence_threshold": 0}})
    case = LOSSES["fused_ce"]
    inner: Any = wrapped.inner
    route = functools.partial(route_loss, gather=[inner.lm_head]) if gather else route_loss
    start = 0.0
    for step in range(steps + 1):
        if step == 1:
            start = time.perf_counter()  # step 0 warms up (trace recording, first gathers)
        batch = make_batch(case, config, torch.distributed.get_rank(), step, 0)
        loss = route(wrapped.model, inner, case.compute, inner, batch, {})
        wrapped.backward(loss)
        wrapped.step()
    return (time.perf_counter() - start) / steps


def zero_detection(stage: int) -> dict[str, Any]:
    from wrapperroute.check.wrap_deepspeed import build_zero

    wrapped = build_zero(build_model(TinyConfig()), {"stage": stage, "gradient_accumulation_steps": 2})
    found = detect(wrapped.model)
    compiled = detect(torch.compile(wrapped.model))  # type: ignore[arg-type]
    return {
        "kind": found.kind,
        "chain": found.chain,
        "details": found.details,
        "inner_ok": found.inner is wrapped.inner,
        "compiled_chain": compiled.chain,
        "compiled_wrapper_ok": compiled.wrapper is wrapped.model,
    }


def zero3_bad_gather() -> str:
    """gather= naming a module that is not in the engine's model: a clear RouteValueError."""
    from wrapperroute.check.wrap_deepspeed import build_zero
    from wrapperroute.errors import RouteValueError

    wrapped = build_zero(build_model(TinyConfig()), {"stage": 3})
    stranger = nn.Linear(2, 2)
    try:
        route_loss(wrapped.model, wrapped.inner, lambda: torch.zeros(()), gather=[stranger])
    except RouteValueError as error:
        return str(error)
    return "no error"
