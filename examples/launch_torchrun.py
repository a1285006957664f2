"""DDP on CPU ranks:  torchrun --nproc_per_node 2 examples/launch_torchrun.py"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(__file__))
import _common

from wrapperroute import detect, route_loss


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    inner = _common.model()
    ddp = DistributedDataParallel(inner)
    loss = route_loss(ddp, inner, _common.fused_ce, inner, _common.batch(rank))
    loss.backward()
    grad = inner.lm_head.weight.grad
    assert grad is not None
    grads = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
    dist.all_gather(grads, grad)
    agree = all(torch.equal(g, grad) for g in grads)
    print(f"rank {rank}: {detect(ddp).chain} loss={loss.item():.4f} ranks_agree={agree}")
    # No destroy_process_group(): measured here, gloo's teardown can hang one rank at exit (the same shutdown
    # problem wrapperroute.ranks works around); the launcher reaps the processes.


if __name__ == "__main__":
    main()
