"""Rank bodies for tests/test_fsdp2_layouts.py (module level: the pool pickles them by reference)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from wrapperroute import RouteStateError, route_loss
from wrapperroute.check.losses import LOSSES, make_batch
from wrapperroute.check.models import TinyConfig, build_model


def agree_on_sub_meshes() -> dict[str, Any]:
    """Two FSDP2 models on disjoint halves of the world (ranks 0-1 and 2-3), each step with ``agree=True``;
    rank 1's loss fails. Only its own half must hear of it: the other half's step is not that wrapper's."""
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

    outcome: dict[str, Any] = {"rank": rank}
    try:
        route_loss(model, model, loss, agree=True).backward()
        outcome["raised"] = None
    except (RouteStateError, ValueError) as error:
        outcome["raised"] = f"{type(error).__name__}: {error}"
    dist.barrier()  # the pool's own group: every rank is back in step
    return outcome


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
