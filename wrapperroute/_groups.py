"""Process groups of our own beside the script's, and the one byte exchange every cross-rank comparison uses.

- **Side groups** live as long as the default process group they were made from: destroyed and initialised
  again (a notebook re-running its set-up, a sweep of runs in one process), they are made again.
- **Nothing undeclared**: payloads travel as bytes in a ``uint8`` tensor, never through ``all_gather_object``
  (it needs numpy, which torch does not depend on).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_bytes", "collective_device", "side_group", "tensor_bytes"]


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


def all_gather_bytes(payload: bytes, group: Any, device: torch.device, sizes: list[int] | None = None) -> list[bytes]:
    """Every rank's ``payload``, in rank order (``sizes``: every rank's payload length, when known already;
    else one more collective learns them)."""
    world = dist.get_world_size(group)
    if sizes is None:
        mine = torch.tensor([len(payload)], dtype=torch.int64, device=device)
        lengths = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(lengths, mine, group=group)
        sizes = [int(length.item()) for length in lengths]
    longest = max(sizes, default=0)
    sent = torch.zeros(longest, dtype=torch.uint8)
    if payload:
        sent[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    sent = sent.to(device)
    received = [torch.empty_like(sent) for _ in range(world)]
    dist.all_gather(received, sent, group=group)
    return [tensor_bytes(tensor[:size]) for tensor, size in zip(received, sizes, strict=True)]


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """``tensor``'s raw bytes: its dtype and every bit kept."""
    tensor = tensor.cpu().contiguous().clone()  # its own storage, exactly its bytes
    try:
        return bytes(tensor.untyped_storage())
    except TypeError:  # a torch whose storages export no buffer: the same bytes, read as uint8
        return bytes(tensor.reshape(-1).view(torch.uint8).tolist())
