"""Which ranks hold a copy of a tensor equal to this rank's: a process group's ranks, or the ranks of a device
mesh that share this rank's coordinates on every dimension a ``DTensor`` is sharded over (HSDP's replicate
dimension, a tensor-parallel mesh's replicated parameters). Shared by the adapters' ``replicas``."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist


def group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of ``group`` (None: the default group, every rank): the ranks that run a wrapper's step
    together, and each holds a copy of what a replicating wrapper holds on this rank."""
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
    grid = mesh.mesh
    return _mesh_copies(tuple(grid.shape), tuple(grid.flatten().tolist()), tuple(placements), dist.get_rank())


# Keyed by the mesh's layout, not the mesh: a cache must not keep meshes (and their process groups) alive.
@functools.lru_cache(maxsize=256)
def _mesh_copies(
    shape: tuple[int, ...], ranks: tuple[int, ...], placements: tuple[Any, ...], rank: int
) -> tuple[int, ...] | None:
    grid = torch.tensor(ranks, dtype=torch.long).reshape(shape)
    found = (grid == rank).nonzero()
    if not len(found):
        return None  # this rank is not on the mesh
    if any(placement.is_partial() for placement in placements):
        return (rank,)  # pending a reduction: no two ranks hold the same value yet
    coordinate = found[0].tolist()
    index = tuple(coordinate[dim] if placement.is_shard() else slice(None) for dim, placement in enumerate(placements))
    return tuple(sorted(grid[index].flatten().tolist()))
