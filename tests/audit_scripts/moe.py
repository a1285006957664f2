"""DeepSpeed MoE with expert parallelism (``deepspeed.moe.layer.MoE``, 4 experts, ``ep_size`` 2, ZeRO-2): each
rank holds other experts, and trains them with the tokens the all-to-all sends it; expert gradients are reduced
over their own expert-data-parallel group, dense ones over the data-parallel group. In sync as written;
``--bug``: rank 1 scales its dense weight before its second step (its replica of the dense layer drifts)."""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn


class MoEModel(nn.Module):
    def __init__(self, vocab: int, hidden: int) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.dense = nn.Linear(hidden, hidden)
        self.moe = MoE(hidden_size=hidden, expert=nn.Linear(hidden, hidden), num_experts=4, ep_size=2, k=1,
                       min_capacity=16, drop_tokens=False)  # fmt: skip
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.dense(self.embed(ids)))
        out, _aux, _counts = self.moe(hidden)
        return self.lm_head(hidden + out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bug", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    deepspeed.init_distributed("gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)  # the same dense weights everywhere; each rank's experts are its own by design
    model = MoEModel(64, 16)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "all"})
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "zero_optimization": {"stage": 2},
              "zero_allow_untested_optimizer": True}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(groups, lr=0.5), config=config)
    generator = torch.Generator().manual_seed(100 + rank)
    for step in range(3):
        ids = torch.randint(0, 64, (2, 8), generator=generator)
        logits = engine(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), torch.roll(ids, -1, 1).flatten())
        engine.backward(loss)
        if args.bug and step == 1 and rank == 1:
            engine.module.dense.weight.data.mul_(1.01)  # a change on one rank only
        engine.step()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
