"""A pipeline on a (pp2, dp2) mesh of 4 ranks, 1F1B, ``PipelineLoss`` on the last stage: ``--layout pp2_ddp`` (DDP
inside the stages) or ``pp2_fsdp2`` (FSDP2 inside, the head in its own unit). ``--bug scale``: rank 1 scales its
stage-0 gradients by hand before the step (a replica desynced); ``--bug full_tensor``: the loss reads the FSDP2
head's shard whole (``full_tensor()``) instead of routing, around FSDP2's reduce-scatter."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

from wrapperroute import PipelineLoss
from wrapperroute.check import pipeline_cell as pp
from wrapperroute.check.models import build_model, stage_pieces

MICRO = 4


def main() -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=["pp2_ddp", "pp2_fsdp2"], required=True)
    parser.add_argument("--bug", choices=["scale", "full_tensor"])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    where = pp.place(args.layout)
    coordinate = where.coordinate
    module = pp.wrap(stage_pieces(build_model(pp.CONFIG), 2)[coordinate], args.layout, where.other)
    head = pp.inner(module).lm_head

    def summed(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        weight = head.weight.full_tensor() if args.bug == "full_tensor" else head.weight
        logits = output.flatten(0, 1) @ weight.t()
        return F.cross_entropy(logits, target.flatten(), ignore_index=pp.IGNORE, reduction="sum")

    stage = PipelineStage(module, coordinate, 2, torch.device("cpu"), group=where.pp_group)
    routed = PipelineLoss(stage, summed)

    def bare(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return summed(output, target) / routed.divisor  # type: ignore[operator]

    schedule = Schedule1F1B(stage, n_microbatches=MICRO, loss_fn=bare if args.bug == "full_tensor" else routed,
                            scale_grads=False)  # fmt: skip
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    for step in range(args.steps):
        ids, labels = pp.batch(where.replica, step, MICRO)
        routed.begin_step((labels != pp.IGNORE).sum(), schedule)
        schedule.step(*((ids,) if coordinate == 0 else ()), target=labels if coordinate == 1 else None)
        if args.bug == "scale" and dist.get_rank() == 1:
            for param in module.parameters():
                param.grad.mul_(1.5)  # type: ignore[union-attr]
        optimizer.step()
        optimizer.zero_grad()
        print(f"rank {dist.get_rank()} step {step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
