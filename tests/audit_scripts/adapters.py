"""A low-rank adapter added after ``fully_shard`` (transformers PR #48792 / #48873: "N ranks train N different
adapters"): a frozen FSDP2-sharded base, two plain trainable ``nn.Linear`` beside it. ``--sync none`` trains them
as written (each rank its own adapter); ``--sync hand`` averages their gradients by hand before each step;
``--sync shard`` shards the adapter with ``fully_shard`` too (FSDP2 reduces it)."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

from wrapperroute import route_loss
from wrapperroute.check.models import TinyConfig, build_model


class Adapted(nn.Module):
    """The base's hidden states plus a low-rank update: ``h + up(down(h))``."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.base(ids)
        return hidden + self.up(self.down(hidden))


def fused_ce(model: Adapted, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids) @ model.base.lm_head.weight.t()
    return F.cross_entropy(logits.flatten(0, 1), torch.roll(ids, -1, 1).flatten())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sync", choices=["none", "hand", "shard"], default="none")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    config = TinyConfig()
    model = Adapted(build_model(config).requires_grad_(False))
    for block in model.base.blocks:
        fully_shard(block)
    fully_shard(model)
    torch.manual_seed(0)  # the same adapter on every rank, as a PEFT config would build it
    model.down = nn.Linear(config.hidden, 4, bias=False)
    model.up = nn.Linear(4, config.hidden, bias=False)
    if args.sync == "shard":
        fully_shard(model.down)
        fully_shard(model.up)
    adapter = [*model.down.parameters(), *model.up.parameters()]
    optimizer = torch.optim.SGD(adapter, lr=0.5)
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(3):
        ids = torch.randint(0, config.vocab, (2, config.seq), generator=generator)
        route_loss(model, model, fused_ce, model, ids).backward()
        if args.sync == "hand":
            for param in adapter:
                dist.all_reduce(param.grad)
                param.grad /= dist.get_world_size()
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
