"""Rank bodies for tests/test_layers.py: compile, DDP and PEFT in the orders that occur (module level: the pool
pickles them by reference)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from wrapperroute import detect, route_loss
from wrapperroute.check.losses import fused_cross_entropy
from wrapperroute.check.models import TinyConfig, build_model


def layered_route(order: str, routed: bool) -> dict[str, Any]:
    """Wrap the tiny model in LoRA (PEFT), DDP and torch.compile in ``order``; route a fused CE with
    ``unwrapped=None`` and report the detected chain and how many trainable gradients differ across ranks."""
    from peft import LoraConfig, get_peft_model
    from torch.nn.parallel import DistributedDataParallel

    from wrapperroute.check.cell import differing_across_ranks
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
    ids, labels = batch["input_ids"], batch["labels"]
    loss = (
        route_loss(model, None, fused_cross_entropy, inner, ids, labels)
        if routed
        else fused_cross_entropy(inner, ids, labels)
    )
    loss.backward()
    grads = {n: p.grad for n, p in inner.named_parameters() if p.grad is not None}
    differ, worst = differing_across_ranks(grads)
    return {"chain": found.chain, "kind": found.kind, "inner_is_base": inner is base, "params": len(grads),
            "differ": differ, "max_rank_diff": worst}
