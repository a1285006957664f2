"""Rank bodies for tests/test_reliability.py: long runs, and routed models freed with their last reference."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from rankside_reliability import CONFIG, hook_count
from wrapperroute import detect, route_loss
from wrapperroute.check.losses import LOSSES, make_batch
from wrapperroute.check.models import build_model
from wrapperroute.check.wrappers import WRAPPERS


def long_run(wrapper: str, opts: dict[str, Any], steps: int, warmup: int, max_growth_mib: float) -> None:
    """``steps`` routed steps on one model after ``warmup`` ones: the inner forward attribute identical after
    every step, hook counts constant, the RSS grown by at most ``max_growth_mib`` after the warm-up."""
    import gc

    import psutil

    wrapped = WRAPPERS[wrapper].build(build_model(CONFIG), dict(opts))
    case = LOSSES["fused_ce"]
    found = detect(wrapped.model)
    target = found.adapter.redirect_target(found.wrapper)  # type: ignore[union-attr,arg-type]
    forward_before = target.__dict__.get("forward", None)
    hooks_before = hook_count(wrapped.model)
    batches = [make_batch(case, CONFIG, dist.get_rank(), step % 8, 0) for step in range(8)]
    process = psutil.Process()
    rss_warm = 0
    for step in range(warmup + steps):
        if step == warmup:
            gc.collect()
            rss_warm = process.memory_info().rss
        loss = route_loss(wrapped.model, wrapped.inner, case.compute, wrapped.inner, batches[step % 8], {})
        wrapped.backward(loss)
        wrapped.step()
        forward = target.__dict__.get("forward", None)
        assert forward is forward_before, f"step {step}: the forward attribute was {forward_before}, is {forward}"
        hooks = hook_count(wrapped.model)
        assert hooks == hooks_before, f"step {step}: {hooks_before} hooks before the first step, {hooks} now"
    gc.collect()
    growth = (process.memory_info().rss - rss_warm) / 2**20
    assert growth <= max_growth_mib, f"RSS grew {growth:.1f} MiB over {steps} steps after the warm-up"


def released(wrapper: str, opts: dict[str, Any], routed: bool) -> None:
    """Build a wrapped model, take two routed steps (none when not ``routed``: the control), drop every
    reference the test holds, collect: the model and its wrapper are gone, and (routed) the bookkeeping
    route_loss keeps has not grown."""
    import gc
    import weakref

    from wrapperroute._routing.state import routing_state

    def run() -> tuple[weakref.ref[nn.Module], weakref.ref[nn.Module]]:
        wrapped = WRAPPERS[wrapper].build(build_model(CONFIG), dict(opts))
        case = LOSSES["fused_ce"]
        for step in range(2 if routed else 0):
            batch = make_batch(case, CONFIG, dist.get_rank(), step, 0)
            loss = route_loss(wrapped.model, wrapped.inner, case.compute, wrapped.inner, batch, {})
            wrapped.backward(loss)
            wrapped.step()
        return weakref.ref(wrapped.inner), weakref.ref(wrapped.model)

    gc.collect()
    plans, redirections = routing_state().plans, routing_state().swaps
    inner, model = run()
    gc.collect()
    what = "after two routed steps" if routed else "never routed (the control: collectable, or this proves nothing)"
    assert inner() is None, f"the inner module outlived its last reference, {what}"
    assert model() is None, f"the wrapper outlived its last reference, {what}"
    if routed:
        plans_added, swaps_added = routing_state().plans - plans, routing_state().swaps - redirections
        assert plans_added == 0 and swaps_added == 0, f"route_loss kept {plans_added} plans, {swaps_added} swaps"
