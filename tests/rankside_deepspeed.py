"""Rank bodies for tests/test_deepspeed.py (module level: the pool pickles them by reference). Each runs on
every rank of the pool and asserts its facts where it finds them; the timing returns its measurement."""

from __future__ import annotations

import functools
import time
from typing import Any
from unittest import mock

import torch
from torch import nn

from wrapperroute import detect, route_loss
from wrapperroute.check import cell as cell_module
from wrapperroute.check.cell import REFERENCE_TOLERANCE, Cell, run_cell
from wrapperroute.check.models import TinyConfig, build_model


def gathering_exact(cell: Cell) -> None:
    """``run_cell`` with ``gather=[unwrapped.lm_head]`` passed to every route_loss call: exact."""

    def gathering(model: nn.Module, unwrapped: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return route_loss(model, unwrapped, fn, *args, gather=[unwrapped.lm_head], **kwargs)

    with mock.patch.object(cell_module, "route_loss", gathering):
        result = run_cell(cell)
    what = f"{cell.label()} with gather="
    assert result.error is None, f"{what}: {result.error}"
    assert result.params > 0 and result.differ == 0, f"{what}: {result.differ} of {result.params} gradients differ"
    assert result.max_ref_diff <= REFERENCE_TOLERANCE, f"{what}: gradients {result.max_ref_diff:.3g} from one process's"


def time_zero3_gathering(steps: int, gather: bool) -> float:
    """Seconds per routed fused-CE step under ZeRO-3 (persistence 0, vocab 8192 so the head is sizeable):
    returned, for the test to set the two ways side by side."""
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


def zero_detection(stage: int) -> None:
    """A ZeRO ``stage`` engine (gradient accumulation 2) detected as DeepSpeed, its details read, its module the
    inner one; compiled, the same engine under a compile layer."""
    from wrapperroute.check.wrap_deepspeed import build_zero

    wrapped = build_zero(build_model(TinyConfig()), {"stage": stage, "gradient_accumulation_steps": 2})
    found = detect(wrapped.model)
    assert found.kind == "deepspeed", f"ZeRO-{stage} detected as {found.kind}"
    assert found.chain == ("deepspeed", "module"), f"ZeRO-{stage}'s chain: {found.chain}"
    details = {"zero_stage": stage, "gradient_accumulation_steps": 2}
    assert found.details == details, f"ZeRO-{stage}'s details: {found.details}, not {details}"
    assert found.inner is wrapped.inner, f"the inner module found is a {type(found.inner).__name__}, not the engine's"
    compiled = detect(torch.compile(wrapped.model))  # type: ignore[arg-type]
    assert compiled.chain == ("compile", "deepspeed", "module"), f"compiled ZeRO-{stage}'s chain: {compiled.chain}"
    assert compiled.wrapper is wrapped.model, f"compiled, the wrapper found is {type(compiled.wrapper).__name__}"


def zero3_bad_gather() -> None:
    """gather= naming a module that is not in the engine's model: a clear RouteValueError."""
    from wrapperroute.check.wrap_deepspeed import build_zero
    from wrapperroute.errors import RouteValueError

    wrapped = build_zero(build_model(TinyConfig()), {"stage": 3})
    stranger = nn.Linear(2, 2)
    message = "no error"
    try:
        route_loss(wrapped.model, wrapped.inner, lambda: torch.zeros(()), gather=[stranger])
    except RouteValueError as error:
        message = str(error)
    assert "is not inside model" in message, f"gather= of a module outside the model: {message}"
