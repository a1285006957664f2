"""Which ranks hold a copy of a tensor equal to this rank's: a process group's ranks, or the ranks of a device
mesh that share this rank's coordinates on every dimension a ``DTensor`` is sharded over (HSDP's replicate
dimension, a tensor-parallel mesh's replicated parameters). Shared by the adapters' ``replicas``."""

from __future__ import annotations

import functools
from typing import Any

import torch.distributed as dist


def group_copies(group: Any) -> tuple[int, ...]:
    """The global ranks of ``group`` (None: the default group): each holds a copy of what this rank holds."""
    if group is None:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(group))


def dtensor_copies(tensor: Any) -> tuple[int, ...] | None:
    """For a ``DTensor``, the global ranks whose local part equals this rank's (this rank included); None for a
    plain tensor, or when this rank is not on its mesh."""
    mesh = getattr(tensor, "device_mesh", None)
    placements = getattr(tensor, "placements", None)
    if mesh is None or placements is None:
        return None
    return _mesh_copies(mesh, tuple(placements), dist.get_rank())


@functools.lru_cache(maxsize=64)
def _mesh_copies(mesh: Any, placements: tuple[Any, ...], rank: int) -> tuple[int, ...] | None:
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    if any(placement.is_partial() for placement in placements):
        return (rank,)  # pending a reduction: no two ranks hold the same value yet
    index = tuple(coordinate[dim] if placement.is_shard() else slice(None) for dim, placement in enumerate(placements))
    return tuple(sorted(mesh.mesh[index].flatten().tolist()))
