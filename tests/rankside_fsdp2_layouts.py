"""Rank bodies for tests/test_fsdp2_layouts.py (module level: the pool pickles them by reference)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from wrapperroute import RouteStateError, route_loss
from wrapperroute.check.losses import LOSSES, make_batch
from wrapperroute.check.models import TinyConfig, build_model


def agree_on_sub_meshes() -> None:
    """Two FSDP2 models on disjoint halves of the world (ranks 0-1 and 2-3), each step with ``agree=True``;
    rank 1's loss fails. Only its own half hears of it (ranks 0 and 1 raise, naming rank 1 of [0, 1]): the
    other half's step is not that wrapper's, and steps on."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("half", "dp"))["dp"]  # this rank's half
    model = build_model(TinyConfig())
    fully_shard(model, mesh=mesh)
    batch = make_batch(LOSSES["fused_ce"], TinyConfig(), rank, 0, 0)

    def loss() -> torch.Tensor:
        value = LOSSES["fused_ce"].compute(model, batch, {})
        if rank == 1:
            raise ValueError("only rank 1 fails")
        return value

    raised = None
    try:
        route_loss(model, model, loss, agree=True).backward()
    except (RouteStateError, ValueError) as error:
        raised = f"{type(error).__name__}: {error}"
    dist.barrier()  # the pool's own group: every rank is back in step (and reaches its assert)
    if rank < 2:
        assert "failed on rank(s) [1] of [0, 1]" in (raised or ""), f"rank {rank}, in the failing half: {raised}"
    else:
        assert raised is None, f"rank {rank}, in the other half: {raised}"


def experts_over_ep() -> None:
    """Experts sharded over a mesh dimension named ``ep``, replicated over ``dp``, the dense layers FSDP2-sharded
    over ``dp``: the ep dimension is not reported as tensor parallelism, and the experts' copies are the ranks
    sharing this rank's ep coordinate."""
    import sys

    from conftest import REPO
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from wrapperroute import detect
    from wrapperroute.adapters.fsdp2 import FSDP2Adapter

    sys.path.insert(0, str(REPO / "tests" / "audit_scripts"))
    import experts

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    model = experts.ExpertModel(mesh)
    fully_shard(model, mesh=mesh["dp"], ignored_params={model.experts})
    found = detect(model)
    assert found.kind == "fsdp2" and found.tensor_parallel is None, found.tensor_parallel
    copies = {r.name: r.copies for r in FSDP2Adapter().replicas(model)}
    ep = mesh.get_local_rank("ep")
    assert copies["experts"] == (ep, 2 + ep), copies  # the dp replicas of this rank's experts
    assert copies["dense.weight"] == (dist.get_rank(),), copies  # sharded over dp
