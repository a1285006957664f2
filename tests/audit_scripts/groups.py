"""Two independent data-parallel groups in one job of 4 ranks, as two pipeline stages or two experiments hold
them: ``--setup ddp_groups`` (DDP over process groups {0, 1} and {2, 3}) or ``replicate_mesh`` (torch's
composable ``replicate`` over the data-parallel dimension of a 2x2 mesh, stage x dp). Each group trains its own
model (a different seed), so ranks of different groups differ by design. ``--bug`` puts the upstream bug in the
second group: its ranks compute the fused loss from the unwrapped model."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

from wrapperroute import route_loss
from wrapperroute.check.models import TinyConfig, build_model


def fused_ce(inner: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = inner(ids) @ inner.lm_head.weight.t()
    return F.cross_entropy(logits.flatten(0, 1), torch.roll(ids, -1, 1).flatten())


def backbone_ce(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The fused loss from the model's parts, never calling the model: skips DDP's forward, and replicate()'s
    hooks (the module is its own wrapper there)."""
    hidden = model.embed(ids)
    for block in model.blocks:
        hidden = block(hidden)
    logits = hidden @ model.lm_head.weight.t()
    return F.cross_entropy(logits.flatten(0, 1), torch.roll(ids, -1, 1).flatten())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setup", choices=["ddp_groups", "replicate_mesh"], required=True)
    parser.add_argument("--bug", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    stage = rank // 2  # ranks {0, 1} hold one model, {2, 3} another
    config = TinyConfig()
    model = build_model(config, seed=stage)
    if args.setup == "ddp_groups":
        from torch.nn.parallel import DistributedDataParallel

        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
        wrapper: torch.nn.Module = DistributedDataParallel(model, process_group=groups[stage])
    else:
        from torch.distributed._composable.replicate import replicate
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("stage", "dp"))
        wrapper = replicate(model, device_mesh=mesh["dp"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(100 + rank)
    for step in range(3):
        ids = torch.randint(0, config.vocab, (2, config.seq), generator=generator)
        # with --bug, the second group's loss runs outside its wrapper: its ranks train apart
        bug = args.bug and stage == 1
        loss = backbone_ce(model, ids) if bug else route_loss(wrapper, model, fused_ce, model, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
