"""Rank bodies for tests/test_route_fsdp.py (module level: the pool pickles them by reference). Each asserts its
facts where it finds them."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from wrapperroute import route_loss
from wrapperroute.check.cell import REFERENCE_TOLERANCE, Cell, differing_across_ranks, run_cell
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


def shards_after_step(wrapper: str, opts: dict[str, Any]) -> None:
    """After a routed step and an optimizer step, every parameter is sharded again: FSDP2's a DTensor holding
    at most its shard, FSDP1's flat parameters at most theirs with the unsharded buffer freed."""
    wrapped = _step(wrapper, opts)
    wrapped.step()
    world = dist.get_world_size()
    if wrapper == "fsdp2":
        from wrapperroute.check.wrap_fsdp import fsdp2_api

        DTensor = fsdp2_api().DTensor

        for name, p in wrapped.model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            shard = -(-p.shape[0] // world) * (p[0].numel() if p.dim() > 1 else 1)
            assert local.numel() <= shard, f"{name}: {local.numel()} elements held here, a shard is {shard}"
            assert isinstance(p, DTensor), f"{name} is a {type(p).__name__}, not a DTensor: not resharded"
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        for i, unit in enumerate(FSDP.fsdp_modules(wrapped.model)):
            flat = unit._handle.flat_param
            shard = -(-sum(flat._numels) // world)
            assert flat.numel() <= shard, f"unit {i}: {flat.numel()} elements held here, a shard is {shard}"
            full = flat._full_param_padded.untyped_storage().size()
            assert full == 0, f"unit {i}: the unsharded buffer still holds {full} bytes"


def payload_not_cast() -> None:
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
    assert seen["payload"] == "torch.float32", f"the float32 payload reached fn as {seen['payload']}"
    assert seen["lm_head"] == "torch.bfloat16", f"lm_head.weight inside fn is {seen['lm_head']}, not bf16"


def reentrant(wrapper: str, opts: dict[str, Any]) -> None:
    """fn calls route_loss again and calls the wrapper itself: both run as plain calls, gradients exact; and the
    wrapper is usable normally afterwards."""
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
    assert differ == 0, f"{differ} parameters' gradients differ across ranks"
    assert worst <= REFERENCE_TOLERANCE, f"gradients {worst:.3g} from one process's on the global batch"
    after = run_cell(Cell(wrapper=wrapper, wrapper_opts=opts))
    assert after.error is None, f"the next cell on a new {wrapper}: {after.error}"
    assert after.differ == 0 and after.max_ref_diff <= REFERENCE_TOLERANCE, f"the next cell is not exact: {after}"
