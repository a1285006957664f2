"""Rank bodies for tests/test_layers.py: compile, DDP and PEFT in the orders that occur (module level: the pool
pickles them by reference)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from wrapperroute import detect, route_loss
from wrapperroute.check.losses import fused_cross_entropy
from wrapperroute.check.models import TinyConfig, build_model


def _layered_step(order: str, routed: bool) -> tuple[Any, nn.Module, dict[str, torch.Tensor], int]:
    """Wrap the tiny model in LoRA (PEFT), DDP and torch.compile in ``order``; one fused-CE backward, routed
    with ``unwrapped=None`` or not: (what detect found, the base model, the trainable gradients, how many of
    them differ across ranks)."""
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
    differ, _ = differing_across_ranks(grads)
    return found, base, grads, differ


def layered_route(order: str, chain: tuple[str, ...]) -> None:
    """Layered in ``order``: detected as ``chain`` around DDP, the inner module the base model, and the routed
    loss leaves every trainable gradient in sync."""
    found, base, grads, differ = _layered_step(order, routed=True)
    assert found.chain == chain and found.kind == "ddp", f"{order}: detected {found.kind}, {found.chain}"
    assert found.inner is base, f"{order}: the inner module found is a {type(found.inner).__name__}, not the base"
    assert grads and differ == 0, f"{order}, routed: {differ} of {len(grads)} gradients differ across ranks"


def layered_unrouted_differs(order: str) -> None:
    """Layered in ``order``, the loss not routed: the ranks' gradients differ (the premise)."""
    _, _, grads, differ = _layered_step(order, routed=False)
    assert differ > 0, f"{order}, unrouted: all {len(grads)} gradients agree across ranks, the bug does not show"
