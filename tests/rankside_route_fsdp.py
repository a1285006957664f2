"""Rank bodies for tests/test_route_fsdp.py (module level: the pool pickles them by reference)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from wrapperroute import detect, route_loss
from wrapperroute.check.cell import Cell, differing_across_ranks, run_cell
from wrapperroute.check.losses import LOSSES, make_batch
from wrapperroute.check.models import TinyConfig, build_model
from wrapperroute.check.wrappers import WRAPPERS

CONFIG = TinyConfig()


def _step(wrapper: str, opts: dict[str, Any], config: TinyConfig = CONFIG):  # type: ignore[no-untyped-def]
    wrapped = WRAPPERS[wrapper].build(build_model(config), opts)
    case = LOSSES["fused_ce"]
    batch = make_batch(case, config, dist.get_rank(), 0, 0)
    route_loss(wrapped.model, wrapped.inner, case.compute, wrapped.inner, batch, {}).backward()
    return wrapped


def shards_after_step(wrapper: str, opts: dict[str, Any]) -> dict[str, Any]:
    """After a routed step and an optimizer step, every parameter is sharded again."""
    wrapped = _step(wrapper, opts)
    wrapped.step()
    world = dist.get_world_size()
    facts: dict[str, Any] = {}
    if wrapper == "fsdp2":
        from wrapperroute.check.wrap_fsdp import fsdp2_api

        DTensor = fsdp2_api().DTensor

        for name, p in wrapped.model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            expected = -(-p.shape[0] // world) * (p[0].numel() if p.dim() > 1 else 1)
            facts[name] = {"dtensor": isinstance(p, DTensor), "local": local.numel(), "max_local": expected}
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        for i, unit in enumerate(FSDP.fsdp_modules(wrapped.model)):
            flat = unit._handle.flat_param
            facts[f"unit{i}"] = {
                "local": flat.numel(),
                "max_local": -(-sum(flat._numels) // world),
                "full_storage": flat._full_param_padded.untyped_storage().size(),
            }
    return facts


def payload_not_cast() -> dict[str, Any]:
    """FSDP2 MixedPrecisionPolicy(bf16): a float32 tensor handed to fn stays float32; parameters inside are
    bf16, as in a normal forward (whose root pre-forward would cast that input to bf16)."""
    wrapped = WRAPPERS["fsdp2"].build(build_model(CONFIG), {"mp": "bfloat16"})
    seen: dict[str, str] = {}
    x = torch.ones(2, CONFIG.hidden, dtype=torch.float32)

    def fn(payload: torch.Tensor) -> torch.Tensor:
        seen["payload"] = str(payload.dtype)
        seen["lm_head"] = str(wrapped.inner.lm_head.weight.dtype)
        return (payload.to(wrapped.inner.lm_head.weight.dtype) @ wrapped.inner.lm_head.weight.t()).float().sum()

    route_loss(wrapped.model, wrapped.inner, fn, x).backward()
    return seen


def reentrant(wrapper: str, opts: dict[str, Any]) -> dict[str, Any]:
    """fn calls route_loss again and calls the wrapper itself: both run as plain calls, gradients exact."""
    config = CONFIG
    wrapped = WRAPPERS[wrapper].build(build_model(config), opts)
    reference = build_model(config)
    case = LOSSES["fused_ce"]
    batches = [make_batch(case, config, r, 0, 0) for r in range(dist.get_world_size())]
    batch = batches[dist.get_rank()]

    def loss_calling_the_wrapper() -> torch.Tensor:
        hidden = wrapped.model(batch["input_ids"])  # the wrapper again, from inside the loss
        logits = hidden @ wrapped.inner.lm_head.weight.t()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

    def outer() -> torch.Tensor:
        return route_loss(wrapped.model, wrapped.inner, loss_calling_the_wrapper)

    route_loss(wrapped.model, wrapped.inner, outer).backward()
    grads = wrapped.full_grads()
    differ, _ = differing_across_ranks(grads)
    case.compute(reference, case.concat(batches), {}).backward()
    ref = {n: p.grad for n, p in reference.named_parameters()}
    worst = max(float((grads[n] - ref[n]).abs().max()) for n in ref)
    # and the wrapper is usable normally afterwards
    second = run_cell(Cell(wrapper=wrapper, wrapper_opts=opts))
    return {"differ": differ, "max_ref_diff": worst, "after": second, "kind": detect(wrapped.model).kind}
