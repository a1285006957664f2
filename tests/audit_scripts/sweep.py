"""Two runs in one process (a sweep): the default process group destroyed and initialised again between them.
The first run routes its fused loss; the second reads ``model.module`` (every rank trains its own model). Each run
rendezvous under its own prefix of the launcher's store (the second would otherwise read the first's addresses)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from wrapperroute import route_loss
from wrapperroute.check.models import TinyConfig, build_model


def fused_ce(inner: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = inner(ids) @ inner.lm_head.weight.t()
    return F.cross_entropy(logits.flatten(0, 1), torch.roll(ids, -1, 1).flatten())


def main() -> None:
    config = TinyConfig()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    for run, routed in enumerate((True, False)):
        dist.init_process_group("gloo", store=dist.PrefixStore(f"sweep run {run}", store),
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))  # fmt: skip
        rank = dist.get_rank()
        inner = build_model(config)
        model = DistributedDataParallel(inner)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        generator = torch.Generator().manual_seed(100 + rank)
        for step in range(2):
            ids = torch.randint(0, config.vocab, (2, config.seq), generator=generator)
            loss = route_loss(model, inner, fused_ce, inner, ids) if routed else fused_ce(model.module, ids)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            print(f"run {run} rank {rank} step {step} loss {loss.item():.6f}", flush=True)
        del model, optimizer
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
