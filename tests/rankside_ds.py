"""Rank-side functions for the DeepSpeed, accelerate and layer tests (module level: the pool pickles them by
reference). Each runs on every rank of the pool and returns plain data for the test to assert on."""

from __future__ import annotations

import functools
import time
from typing import Any
from unittest import mock

import torch
from torch import nn

from wrapperroute import detect, route_loss
from wrapperroute.check import cell as cell_module
from wrapperroute.check.cell import Cell, run_cell
from wrapperroute.check.models import TinyConfig, build_model


def run_cell_gathering(cell: Cell) -> dict[str, Any]:
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


# --- accelerate --------------------------------------------------------------------------------------------


def _fresh_accelerator(**kwargs: Any) -> Any:
    import os

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)  # one pool process serves many tests
    GradientState._reset_state()
    for key in [k for k in os.environ if k.startswith("ACCELERATE_")]:  # left by a previous DeepSpeed plugin
        del os.environ[key]
    # cpu=True: MULTI_CPU (DDP over our gloo group); DeepSpeed is only taken on the non-cpu path.
    return Accelerator(cpu="deepspeed_plugin" not in kwargs, **kwargs)


def accelerate_gradient_truth(plugin: str, steps: int = 2) -> dict[str, Any]:
    """fused CE routed through ``Accelerator.prepare``'d model (``plugin``: "ddp" or "zero3"), gradients
    compared across ranks and with a single process on the global batch, as in check/cell.py."""
    import torch.distributed as dist

    from wrapperroute.check.cell import _compare_across_ranks, _max_diff
    from wrapperroute.check.losses import LOSSES, make_batch
    from wrapperroute.check.wrappers import build_none

    kwargs: dict[str, Any] = {}
    if plugin == "zero3":
        from accelerate.utils import DeepSpeedPlugin

        from wrapperroute.check.wrap_deepspeed import zero_config

        ds_config = zero_config(3, stage3_param_persistence_threshold=0)
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=ds_config)
    accelerator = _fresh_accelerator(**kwargs)
    case, config = LOSSES["fused_ce"], TinyConfig()
    model = build_model(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    unwrapped = accelerator.unwrap_model(prepared)
    reference = build_none(build_model(config), {})
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {"chain": detect(prepared).chain, "differ": 0, "max_ref_diff": 0.0}
    for step in range(steps):
        batch = make_batch(case, config, rank, step, 0)
        loss = route_loss(prepared, unwrapped, case.compute, unwrapped, batch, {})
        accelerator.backward(loss)
        if plugin == "zero3":
            from deepspeed.utils import safe_get_full_grad

            grads = {n: safe_get_full_grad(p).detach().clone() for n, p in unwrapped.named_parameters()}
        else:
            grads = {n: p.grad.detach().clone() for n, p in unwrapped.named_parameters()}
        differ, _ = _compare_across_ranks(grads)
        global_batch = case.concat([make_batch(case, config, r, step, 0) for r in range(world)])
        case.compute(reference.model, global_batch, {}).backward()  # type: ignore[arg-type]
        out["differ"] = max(out["differ"], differ)
        out["max_ref_diff"] = max(out["max_ref_diff"], _max_diff(grads, reference.full_grads()))
        out["params"] = len(grads)
        optimizer.step()
        optimizer.zero_grad()
        reference.step()
    return out


def _naive_redirect(wrapper: nn.Module, inner: nn.Module, fn: Any) -> Any:
    """Lightning's/TRL's ``_ForwardRedirection``: assign ``inner.forward``, call the wrapper, put it back."""
    original = inner.forward

    def wrapped_forward(*args: Any, **kwargs: Any) -> Any:
        inner.forward = original
        return fn()

    inner.forward = wrapped_forward
    return wrapper()


def accelerate_autocast_inside(mixed_precision: str) -> dict[str, Any]:
    """Whether the user's autocast is in force inside ``fn``: normal forward, ours, a naive redirection."""
    accelerator = _fresh_accelerator(mixed_precision=mixed_precision)
    model = build_model(TinyConfig())
    prepared = accelerator.prepare(model)
    unwrapped = accelerator.unwrap_model(prepared)
    ids = torch.randint(0, 512, (2, 8))
    seen: dict[str, Any] = {}

    def probe(name: str) -> torch.Tensor:
        hidden = unwrapped(ids)
        logits = hidden @ unwrapped.lm_head.weight.t()
        seen[name] = (torch.is_autocast_enabled("cpu"), str(logits.dtype))
        return logits.float().mean()

    handle = unwrapped.blocks[0].proj.register_forward_hook(
        lambda module, args, output: seen.__setitem__("normal", (torch.is_autocast_enabled("cpu"), str(output.dtype)))
    )
    prepared(ids)
    handle.remove()
    route_loss(prepared, unwrapped, probe, "routed").backward()
    _naive_redirect(prepared, unwrapped, lambda: probe("naive")).backward()
    seen["after"] = torch.is_autocast_enabled("cpu")
    seen["forward_restored"] = "forward" in unwrapped.__dict__ and hasattr(unwrapped, "_original_forward")
    return seen


def accelerate_accumulate_no_sync() -> dict[str, Any]:
    """Inside ``accelerator.accumulate`` on a non-boundary micro-batch, routed gradients stay local (DDP's
    no_sync honoured); on the boundary they are synced."""
    from wrapperroute.check.losses import LOSSES, make_batch

    accelerator = _fresh_accelerator(gradient_accumulation_steps=2)
    case, config = LOSSES["fused_ce"], TinyConfig()
    prepared = accelerator.prepare(build_model(config))
    unwrapped = accelerator.unwrap_model(prepared)
    rank = torch.distributed.get_rank()
    from wrapperroute.check.cell import _compare_across_ranks

    differs = []
    for micro in range(2):
        with accelerator.accumulate(prepared):
            batch = make_batch(case, config, rank, 0, micro)
            loss = route_loss(prepared, unwrapped, case.compute, unwrapped, batch, {})
            accelerator.backward(loss)
        grads = {n: p.grad for n, p in unwrapped.named_parameters() if p.grad is not None}
        differs.append(_compare_across_ranks(grads)[0])
    return {"differ_per_micro": differs, "params": len(list(unwrapped.parameters()))}


# --- layers: compile / DDP / PEFT in the orders that occur -------------------------------------------------


def _fused_ce_on(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    from wrapperroute.check.losses import LOSSES

    return LOSSES["fused_ce"].compute(model, batch, {})  # type: ignore[arg-type]


def layered_route(order: str, routed: bool) -> dict[str, Any]:
    """Wrap the tiny model in LoRA (PEFT), DDP and torch.compile in ``order``; route a fused CE with
    ``unwrapped=None`` and report the detected chain and how many trainable gradients differ across ranks."""
    from peft import LoraConfig, get_peft_model
    from torch.nn.parallel import DistributedDataParallel

    from wrapperroute.check.cell import _compare_across_ranks
    from wrapperroute.check.losses import LOSSES, make_batch

    config = TinyConfig()
    base = build_model(config)
    model: nn.Module = base
    for layer in order.split(","):
        if layer == "peft":
            model = get_peft_model(model, LoraConfig(r=4, target_modules=["proj"], init_lora_weights=False))
        elif layer == "ddp":
            model = DistributedDataParallel(model)
        elif layer == "compile":
            model = torch.compile(model)  # type: ignore[assignment]
    found = detect(model)
    inner = found.inner
    batch = make_batch(LOSSES["fused_ce"], config, torch.distributed.get_rank(), 0, 0)
    loss = route_loss(model, None, _fused_ce_on, inner, batch) if routed else _fused_ce_on(inner, batch)
    loss.backward()
    grads = {n: p.grad for n, p in inner.named_parameters() if p.grad is not None}
    differ, worst = _compare_across_ranks(grads)
    return {"chain": found.chain, "kind": found.kind, "inner_is_base": inner is base, "params": len(grads),
            "differ": differ, "max_rank_diff": worst}
