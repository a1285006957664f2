"""Rank bodies for tests/test_accelerate.py (module level: the pool pickles them by reference). Each runs on
every rank of the pool and asserts its facts where it finds them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from wrapperroute import detect, route_loss
from wrapperroute.check.models import TinyConfig, build_model


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


def accelerate_gradient_truth(plugin: str, chain: tuple[str, ...], steps: int = 2) -> None:
    """fused CE routed through ``Accelerator.prepare``'d model (``plugin``: "ddp" or "zero3", detected as
    ``chain``), each step's gradients the same on every rank (all 6 parameters) and a single process's on the
    global batch, as in check/cell.py."""
    import torch.distributed as dist

    from wrapperroute.check.cell import REFERENCE_TOLERANCE, differing_across_ranks, max_grad_diff
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
    found = detect(prepared).chain
    assert found == chain, f"Accelerator.prepare with {plugin}: detected {found}, not {chain}"
    for step in range(steps):
        batch = make_batch(case, config, rank, step, 0)
        loss = route_loss(prepared, unwrapped, case.compute, unwrapped, batch, {})
        accelerator.backward(loss)
        if plugin == "zero3":
            from deepspeed.utils import safe_get_full_grad

            grads = {n: safe_get_full_grad(p).detach().clone() for n, p in unwrapped.named_parameters()}
        else:
            grads = {n: p.grad.detach().clone() for n, p in unwrapped.named_parameters()}
        differ, _ = differing_across_ranks(grads)
        global_batch = case.concat([make_batch(case, config, r, step, 0) for r in range(world)])
        case.compute(reference.model, global_batch, {}).backward()  # type: ignore[arg-type]
        ref_diff = max_grad_diff(grads, reference.full_grads())
        assert len(grads) == 6, f"step {step}: {len(grads)} gradients, not the tiny model's 6"
        assert differ == 0, f"step {step}: {differ} parameters' gradients differ across ranks"
        assert ref_diff <= REFERENCE_TOLERANCE, f"step {step}: gradients {ref_diff:.3g} from one process's"
        optimizer.step()
        optimizer.zero_grad()
        reference.step()


def _naive_redirect(wrapper: nn.Module, inner: nn.Module, fn: Any) -> Any:
    """Lightning's/TRL's ``_ForwardRedirection``: assign ``inner.forward``, call the wrapper, put it back."""
    original = inner.forward

    def wrapped_forward(*args: Any, **kwargs: Any) -> Any:
        inner.forward = original
        return fn()

    inner.forward = wrapped_forward
    return wrapper()


def bf16_autocast_inside() -> None:
    """Accelerate's bf16 autocast is in force in a normal forward and inside our routed ``fn``, not inside a naive
    redirection's; off after them, and the prepared model's own autocast forward kept."""
    accelerator = _fresh_accelerator(mixed_precision="bf16")
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
    bf16, fp32 = (True, "torch.bfloat16"), (False, "torch.float32")
    assert seen["normal"] == bf16, f"a normal forward of this model runs in (autocast, dtype) {seen['normal']}"
    route_loss(prepared, unwrapped, probe, "routed").backward()
    assert seen["routed"] == bf16, f"the routed loss runs in (autocast, dtype) {seen['routed']}, not {bf16}"
    _naive_redirect(prepared, unwrapped, lambda: probe("naive")).backward()
    assert seen["naive"] == fp32, f"a naive redirection runs in (autocast, dtype) {seen['naive']}: it kept autocast"
    assert not torch.is_autocast_enabled("cpu"), "autocast is still on after the calls"
    kept = "forward" in unwrapped.__dict__ and hasattr(unwrapped, "_original_forward")
    assert kept, "accelerate's autocast forward on the model is gone"


def accelerate_accumulate_no_sync() -> None:
    """Inside ``accelerator.accumulate`` on a non-boundary micro-batch, routed gradients stay local (DDP's
    no_sync honoured); on the boundary they are synced."""
    from wrapperroute.check.losses import LOSSES, make_batch

    accelerator = _fresh_accelerator(gradient_accumulation_steps=2)
    case, config = LOSSES["fused_ce"], TinyConfig()
    prepared = accelerator.prepare(build_model(config))
    unwrapped = accelerator.unwrap_model(prepared)
    rank = torch.distributed.get_rank()
    from wrapperroute.check.cell import differing_across_ranks

    for micro in range(2):
        with accelerator.accumulate(prepared):
            batch = make_batch(case, config, rank, 0, micro)
            loss = route_loss(prepared, unwrapped, case.compute, unwrapped, batch, {})
            accelerator.backward(loss)
        grads = {n: p.grad for n, p in unwrapped.named_parameters() if p.grad is not None}
        differ = differing_across_ranks(grads)[0]
        if micro == 0:  # not the boundary: local gradients only
            assert differ > 0, "the first micro-batch's gradients agree across ranks: no_sync was not honoured"
        else:  # the boundary: synced
            assert differ == 0, f"at the boundary {differ} parameters' gradients differ across ranks"
