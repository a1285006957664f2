"""In-sync training scripts the audit must not flag: ``--setup zero2`` (DeepSpeed ZeRO-2), ``hsdp`` (FSDP2 on
a 2x2 mesh, replicate x shard: 4 ranks), ``replicate`` (torch's composable replicate), each a few steps of the
fused loss through wrapperroute."""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from wrapperroute import route_loss
from wrapperroute.check.models import TinyConfig, build_model


def fused_ce(inner: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = inner(ids) @ inner.lm_head.weight.t()
    return F.cross_entropy(logits.flatten(0, 1), torch.roll(ids, -1, 1).flatten())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setup", choices=["zero2", "zero3", "hsdp", "replicate"], required=True)
    args = parser.parse_args()
    config = TinyConfig()
    model = build_model(config)
    if args.setup in ("zero2", "zero3"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        deepspeed.init_distributed("gloo")
        config_ds = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
                     "zero_optimization": {"stage": int(args.setup[-1])},
                     "zero_allow_untested_optimizer": True}  # fmt: skip
        engine, optimizer, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), config=config_ds
        )
        wrapper, inner = engine, engine.module
    else:
        dist.init_process_group("gloo")
        if args.setup == "hsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("replicate", "shard"))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:
            from torch.distributed._composable.replicate import replicate

            replicate(model)
        wrapper = inner = model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    for step in range(3):
        ids = torch.randint(0, config.vocab, (2, config.seq), generator=generator)
        loss = route_loss(wrapper, inner, fused_ce, inner, ids)
        if args.setup in ("zero2", "zero3"):
            engine.backward(loss)
            engine.step()
        else:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        print(f"rank {dist.get_rank()} step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
