"""DPO and KTO on a head sharded on the vocabulary (tensor parallelism), built on ``wrapperroute.losses``.

The two losses below are what a trainer or a TRL fork writes in place of Liger's chunked ones when its head is a
``DTensor`` (transformers' ``DistributedConfig(tp_size=...)``, ``ColwiseParallel`` on ``lm_head``): the same
arithmetic as ``LigerFusedLinearDPOLoss`` / ``LigerFusedLinearKTOLoss`` (sequence log-probabilities summed over
the tokens not ignored), on per-token log-probabilities that never gather the vocabulary.

Run on 4 CPU ranks, 2 data-parallel replicas of a model whose head is split over 2 tensor-parallel ranks::

    torchrun --nproc-per-node 4 examples/tp_preference.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from wrapperroute.losses import linear_logprobs


def sequence_logprobs(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                      ignore_index: int = -100) -> torch.Tensor:  # fmt: skip
    """Each sequence's log-probability, summed over its tokens not ignored: ``hidden`` (B, T, H), ``target``
    (B, T), ``weight`` the head (plain, or sharded on the vocabulary)."""
    keep = target != ignore_index
    logps = linear_logprobs(hidden.flatten(0, 1), weight, torch.where(keep, target, 0).flatten())
    return (logps.view(target.shape) * keep).sum(dim=1)


def dpo_loss(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ref_hidden: torch.Tensor,
             ref_weight: torch.Tensor, beta: float = 0.1) -> torch.Tensor:  # fmt: skip
    """Sigmoid DPO; the batch's first half are the chosen sequences, the second half the rejected ones."""
    logps = sequence_logprobs(hidden, weight, target)
    with torch.no_grad():
        ref = sequence_logprobs(ref_hidden, ref_weight, target)
    chosen, rejected = (logps - ref).chunk(2)
    return -F.logsigmoid(beta * (chosen - rejected)).sum() / chosen.shape[0]


def kto_loss(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, preference: torch.Tensor,
             ref_hidden: torch.Tensor, ref_weight: torch.Tensor, beta: float = 0.1) -> torch.Tensor:  # fmt: skip
    """KTO without a KL estimate (Liger's default): ``preference`` True for desirable sequences."""
    logps = sequence_logprobs(hidden, weight, target)
    with torch.no_grad():
        ref = sequence_logprobs(ref_hidden, ref_weight, target)
    sign = torch.where(preference, 1.0, -1.0)
    return (1 - torch.sigmoid(beta * (logps - ref) * sign)).sum() / target.shape[0]


def main() -> None:
    import torch.distributed as dist
    from _common import CONFIG, model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from wrapperroute import check_grad_sync, detect, route_loss

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
    policy, reference = model(), model().requires_grad_(False)
    for each in (policy, reference):
        parallelize_module(each, mesh["tp"], {"lm_head": ColwiseParallel(use_local_output=False)})
    fully_shard(policy, mesh=mesh["dp"])  # FSDP over dp: the data-parallel wrapper routed through
    generator = torch.Generator().manual_seed(mesh["dp"].get_local_rank())  # one batch per replica
    ids = torch.randint(0, CONFIG.vocab, (4, CONFIG.seq), generator=generator)
    target = torch.roll(ids, -1, dims=1)

    def loss(inner: torch.nn.Module) -> torch.Tensor:
        return dpo_loss(inner(ids), inner.lm_head.weight, target, reference(ids), reference.lm_head.weight)

    route_loss(policy, policy, loss, policy).backward()
    found = detect(policy)
    print(f"rank {dist.get_rank()}: {found.kind} {found.tensor_parallel}, {check_grad_sync(policy)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
