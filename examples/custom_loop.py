"""A custom DDP training loop whose fused loss reads ``lm_head.weight`` directly, routed with ``route_loss``.

Run on 2 CPU ranks, no GPU, nothing downloaded::

    python examples/custom_loop.py                 # spawns 2 gloo ranks itself
    torchrun --nproc-per-node 2 examples/custom_loop.py

Prints, per step, how many parameters' gradients differ across ranks: 0 routed, all of them unrouted.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from wrapperroute import check_grad_sync, route_loss
from wrapperroute.check.models import TinyCausalLM, TinyConfig, build_model


def fused_loss(model: TinyCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Logits from the head's weight, not the head module: the pattern that skips DDP's forward."""
    logits = model(ids[:, :-1]) @ model.lm_head.weight.t()
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def train(routed: bool, steps: int = 3) -> list[int]:
    config = TinyConfig()
    model = build_model(config)
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    differing = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(100 * step + dist.get_rank())  # different data per rank
        ids = torch.randint(0, config.vocab, (4, config.seq), generator=generator)
        if routed:  # noqa: SIM108 (two commented branches read better than one ternary)
            # ddp(...) runs, so the reducer is armed and backward all-reduces; fn sees the unwrapped model.
            loss = route_loss(ddp, model, fused_loss, model, ids)
        else:
            loss = fused_loss(model, ids)  # DDP.forward never runs: every rank keeps its own gradients
        loss.backward()
        differing.append(check_grad_sync(ddp).differing)  # every gradient compared across ranks
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return differing


def main() -> dict[str, list[int]]:
    result = {"routed": train(routed=True), "unrouted": train(routed=False)}
    if dist.get_rank() == 0:
        params = sum(1 for _ in build_model(TinyConfig()).parameters())
        print(f"parameters differing across ranks per step (of {params}): {result}", flush=True)
    return result


if __name__ == "__main__":
    if "RANK" in os.environ and not dist.is_initialized():  # under torchrun
        dist.init_process_group("gloo")
        main()
        dist.destroy_process_group()
    else:
        from wrapperroute.ranks import RankPool

        with RankPool(2) as pool:
            results = pool.run(main)
        assert results[0]["routed"] == [0, 0, 0], results
