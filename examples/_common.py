"""Shared by the launcher examples: the embedded tiny model, one batch per rank, the fused loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wrapperroute.check.models import TinyCausalLM, TinyConfig, build_model

CONFIG = TinyConfig()


def model() -> TinyCausalLM:
    return build_model(CONFIG)


def batch(rank: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, CONFIG.vocab, (2, CONFIG.seq), generator=torch.Generator().manual_seed(rank))
    return {"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)}


def fused_ce(unwrapped: TinyCausalLM, data: dict[str, torch.Tensor]) -> torch.Tensor:
    hidden = unwrapped(data["input_ids"])
    logits = hidden @ unwrapped.lm_head.weight.t()  # reads the weight: must run inside the wrapper
    return F.cross_entropy(logits.flatten(0, 1), data["labels"].flatten())
