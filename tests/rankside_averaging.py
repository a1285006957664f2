"""Rank bodies for the averaging adapters read off wrappers whose parameter groups span different meshes (module
level: the pool pickles them by reference)."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from wrapperroute.adapters.fsdp2 import FSDP2Adapter
from wrapperroute.check.models import TinyConfig, build_model


def nested_meshes() -> None:
    """Dense layers sharded over every rank, the head over the ranks of one half (as torchtitan shards experts
    over an expert-parallel group), dividing by the dense factor: the tokens are counted over every rank. With
    the head dividing by another factor, which divisor holds cannot be told: None."""
    from torch.distributed.fsdp import fully_shard

    world = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    half = init_device_mesh("cpu", (2, 2), mesh_dim_names=("group", "dp"))["dp"]
    model = build_model(TinyConfig())
    head = model.get_submodule("lm_head")
    fully_shard(head, mesh=half)
    fully_shard(model, mesh=world)
    head.set_gradient_divide_factor(4.0)  # type: ignore[operator]
    averaging = FSDP2Adapter().averaging(model)
    assert averaging is not None and averaging.ranks == (0, 1, 2, 3) and averaging.divides_by == 4.0, averaging
    head.set_gradient_divide_factor(2.0)  # type: ignore[operator]
    assert FSDP2Adapter().averaging(model) is None, "groups dividing by 4 and by 2: no one divisor"
    dist.barrier()
