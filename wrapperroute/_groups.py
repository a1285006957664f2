"""Ranks and process groups: which global ranks a group holds, which ranks hold a copy of a ``DTensor``'s local
part, where a group's collectives need their tensors, and process groups of our own beside the script's.

- **Copies**: a process group's ranks, or the ranks of a device mesh that share this rank's coordinates on every
  dimension a ``DTensor`` is sharded over (HSDP's replicate dimension, a tensor-parallel mesh's replicated
  parameters): what the adapters' ``replicas`` and ``averaging`` name.
- **Side groups** live as long as the default process group they were made from: destroyed and initialised
  again (a notebook re-running its set-up, a sweep of runs in one process), they are made again.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "collective_device", "dtensor_copies", "group_ranks", "initialized", "made_side_group", "side_group", "world_size",
]  # fmt: skip


def initialized() -> bool:
    """Whether a default process group exists (not before ``init_process_group``, nor after it is destroyed, nor in
    a torch built without ``torch.distributed``)."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """How many ranks the default process group runs; 1 with none."""
    return dist.get_world_size() if initialized() else 1


_side_groups: dict[tuple[tuple[int, ...] | None, str | None], Any] = {}
_made_under: weakref.ref[Any] | None = None  # the default group the side groups were made from


def side_group(ranks: Sequence[int] | None = None, backend: str | None = None) -> Any:
    """A process group of our own beside the script's, so our collectives never pair with the script's.

    ``ranks`` None: every rank, created by every rank at the same point. A tuple of ranks: created by those
    ranks alone (``use_local_synchronization``), whenever they first ask. Made again after the default group is
    destroyed and initialised again."""
    global _made_under
    world = dist.group.WORLD
    if _made_under is None or _made_under() is not world:
        _side_groups.clear()
        _made_under = weakref.ref(world) if world is not None else None
    key = (None if ranks is None else tuple(ranks), backend)
    group = _side_groups.get(key)
    if group is None:
        if ranks is None:
            group = dist.new_group(backend=backend)
        else:
            group = dist.new_group(list(ranks), backend=backend, use_local_synchronization=True)
        _side_groups[key] = group
    return group


def made_side_group(ranks: Sequence[int] | None = None, backend: str | None = None) -> Any:
    """The side group :func:`side_group` made for these arguments under the current default group, or None when
    none was made (asking makes nothing: making one is a collective)."""
    if _made_under is None or _made_under() is not dist.group.WORLD:
        return None
    return _side_groups.get((None if ranks is None else tuple(ranks), backend))


def collective_device(group: Any = None) -> torch.device:
    """Where a tensor for ``group``'s collectives must live: the CPU when the group has a CPU backend (gloo,
    torch's default ``cpu:gloo,cuda:nccl``), else the current accelerator (``cuda:nccl``)."""
    config = str(dist.get_backend_config(group))
    devices = {part.split(":", 1)[0].strip() for part in config.split(",") if ":" in part}
    if not devices or "cpu" in devices:
        return torch.device("cpu")
    kind = sorted(devices)[0]
    module = getattr(torch, kind, None)
    current = getattr(module, "current_device", None)
    return torch.device(kind, current()) if callable(current) else torch.device(kind)


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
    # Every placement but Replicate splits the tensor over its dimension: Shard, and FSDP2's _StridedShard beside
    # a tensor-parallel one (not a Shard: ``is_shard()`` is False for it on torch 2.13)
    index = tuple(slice(None) if each.is_replicate() else coordinate[dim] for dim, each in enumerate(placements))
    return tuple(sorted(grid[index].flatten().tolist()))
