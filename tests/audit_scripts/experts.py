"""Experts laid out as torchtitan lays them, on 4 ranks: a (dp, ep) mesh; the experts a ``DTensor`` sharded over
``ep`` (each ep rank holds other experts) and replicated over ``dp`` (their gradients averaged over ``dp`` by
hand, as torchtitan's expert FSDP over ``dp_shard_mod_ep`` does); the dense layers FSDP2-sharded over the 2-D
mesh (HSDP: replicated over ``dp``, sharded over ``ep``). Each rank sends its tokens to its own experts (no
all-to-all: what is audited is which copies must agree). In sync as written; ``--bug``: rank 1 scales its dense
gradients before the second step."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from wrapperroute import route_loss

VOCAB, HIDDEN, EXPERTS = 64, 16, 4


class ExpertModel(nn.Module):
    def __init__(self, mesh: object) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.dense = nn.Linear(HIDDEN, HIDDEN)
        experts = torch.randn(EXPERTS, HIDDEN, HIDDEN) / HIDDEN
        self.experts = nn.Parameter(distribute_tensor(experts, mesh, [Replicate(), Shard(0)]))
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.dense(self.embed(ids)))
        local = self.experts.to_local()  # type: ignore[attr-defined]  # this ep rank's experts
        chosen = local[ids % local.shape[0]]  # each token to one of them
        return hidden + torch.tanh(torch.einsum("bsh,bshk->bsk", hidden, chosen))


def fused_ce(model: ExpertModel, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids) @ model.lm_head.weight.t()
    return F.cross_entropy(logits.flatten(0, 1), torch.roll(ids, -1, 1).flatten())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bug", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    torch.manual_seed(0)
    model = ExpertModel(mesh)
    fully_shard(model, mesh=mesh, ignored_params={model.experts})  # HSDP for the dense layers
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    dp = mesh.get_group("dp")
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    for step in range(3):
        ids = torch.randint(0, VOCAB, (2, 8), generator=generator)
        route_loss(model, model, fused_ce, model, ids).backward()
        grad = model.experts.grad.to_local()  # type: ignore[union-attr]
        dist.all_reduce(grad, group=dp)
        grad /= dist.get_world_size(dp)
        if args.bug and step == 1 and dist.get_rank() == 1:
            for param in model.dense.parameters():
                param.grad.to_local().mul_(2.0)  # type: ignore[union-attr]
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
