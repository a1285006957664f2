"""DeepSpeed ZeRO-3 on CPU ranks:  DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/launch_deepspeed.py
(or torchrun --nproc_per_node 2 examples/launch_deepspeed.py)"""

from __future__ import annotations

import os
import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_grad

sys.path.insert(0, os.path.dirname(__file__))
import _common

from wrapperroute import detect, route_loss

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_clipping": 0.0,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 1 << 30,
}


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    model = _common.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=CONFIG)
    inner = engine.module
    rank = dist.get_rank()
    loss = route_loss(engine, inner, _common.fused_ce, inner, _common.batch(rank))
    engine.backward(loss)
    grad = safe_get_full_grad(inner.lm_head.weight).clone()  # the whole head, although it is partitioned
    grads = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
    dist.all_gather(grads, grad)
    engine.step()
    found = detect(engine)
    agree = all(torch.equal(g, grad) for g in grads)
    print(f"rank {rank}: {found.chain} {found.details} loss={loss.item():.4f} ranks_agree={agree}")


if __name__ == "__main__":
    main()
