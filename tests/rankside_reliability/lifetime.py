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


def long_run(wrapper: str, opts: dict[str, Any], steps: int, warmup: int) -> dict[str, Any]:
    """``steps`` routed steps on one model: the inner forward attribute identical after every step, hook
    counts constant, RSS growth after the warm-up."""
    import gc

    import psutil

    from wrapperroute._routing.state import routing_state

    wrapped = WRAPPERS[wrapper].build(build_model(CONFIG), dict(opts))
    case = LOSSES["fused_ce"]
    found = detect(wrapped.model)
    target = found.adapter.redirect_target(found.wrapper)  # type: ignore[union-attr,arg-type]
    forward_before = target.__dict__.get("forward", None)
    hooks_before = hook_count(wrapped.model)
    batches = [make_batch(case, CONFIG, dist.get_rank(), step % 8, 0) for step in range(8)]
    process = psutil.Process()
    forward_changed = hooks_changed = 0
    rss_warm = 0
    for step in range(warmup + steps):
        if step == warmup:
            gc.collect()
            rss_warm = process.memory_info().rss
        loss = route_loss(wrapped.model, wrapped.inner, case.compute, wrapped.inner, batches[step % 8], {})
        wrapped.backward(loss)
        wrapped.step()
        forward_changed += target.__dict__.get("forward", None) is not forward_before
        hooks_changed += hook_count(wrapped.model) != hooks_before
    gc.collect()
    return {
        "steps": steps,
        "forward_changed": forward_changed,
        "hooks_changed": hooks_changed,
        "rss_growth_mib": (process.memory_info().rss - rss_warm) / 2**20,
        "redirections": routing_state().swaps,
        "plans": routing_state().plans,
    }


def released(wrapper: str, opts: dict[str, Any], routed: bool) -> dict[str, Any]:
    """Build a wrapped model, take ``steps`` routed steps (none when not ``routed``: the control), drop every
    reference the test holds, collect: whether the model and its wrapper are still alive, and the
    bookkeeping route_loss keeps."""
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
    return {
        "inner_alive": inner() is not None,
        "model_alive": model() is not None,
        "plans_added": routing_state().plans - plans,
        "redirections_added": routing_state().swaps - redirections,
    }
