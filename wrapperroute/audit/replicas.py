"""Which tensors of a process are replicas of other ranks' tensors.

Found by looking at the distributed wrappers alive in the process (every ``nn.Module`` a distributed adapter
claims: DDP, composable ``replicate``, FSDP2 units, DeepSpeed engines, FSDP1), so it sees the wrappers a
trainer built inside (accelerate, HF ``Trainer``, Lightning, TRL), not only the ones a script names. Which of
their tensors are replicated, and over which ranks, each wrapper's adapter says (``Topology.replicas``: DDP's
process group, ``replicate``'s mesh dimension, an HSDP mesh's replicate dimension, DeepSpeed's data-parallel
group); two data-parallel groups in one job are compared each within itself. The comparison is
``wrapperroute.crossrank``'s (``replica_rows``, ``compare``): a signature per tensor, suspects sent whole, values
compared NaN-aware.
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..adapters import Assigned, Replica, Topology, registered

CREATION_ORDER = "_wrapperroute_audit_seq"  # creation order of DDP wrappers, stamped by the audit (see session.py)


def wrappers() -> list[tuple[Topology, nn.Module]]:
    """Every distributed wrapper alive in this process (outermost only), in an order the same on every rank:
    DDP wrappers by creation, the rest by kind and structure."""
    adapters = [adapter for adapter in registered() if isinstance(adapter, Topology)]
    found: list[tuple[Topology, nn.Module]] = []
    gc.collect()  # a wrapper freed but not yet collected on one rank would shift every later key's position
    for obj in gc.get_objects():
        if issubclass(type(obj), nn.Module):  # type(), not isinstance: proxies warn when asked their class
            for adapter in adapters:
                if adapter.claims(obj):
                    found.append((adapter, obj))
                    break
    inner = {id(sub) for _, wrapper in found for sub in wrapper.modules() if sub is not wrapper}
    inner |= {id(kept) for adapter, wrapper in found for kept in adapter.inner_wrappers(wrapper)}
    outer = [(adapter, wrapper) for adapter, wrapper in found if id(wrapper) not in inner]

    def order(item: tuple[Topology, nn.Module]) -> tuple[Any, ...]:
        adapter, wrapper = item
        shapes = tuple((name, tuple(p.shape)) for name, p in wrapper.named_parameters())
        return (adapter.kind, getattr(wrapper, CREATION_ORDER, 0), shapes)

    return sorted(outer, key=order)


@dataclass(frozen=True)
class Found:
    """The replicas of every wrapper: those with copies to compare, and by why, the count of those without."""

    replicas: list[Replica]
    alone: dict[str, int]
    kinds: list[str]
    # (prefix of the names, kind, wrapper, its sharded parameters whose gradients it assigns itself): arrivals.py
    assigned: list[tuple[str, str, nn.Module, Assigned]] = dataclasses.field(default_factory=list)


def replicas(known: list[tuple[Topology, nn.Module]] | None = None) -> Found:
    """The trainable parameters of every wrapper (of ``known``, else of every wrapper alive), each named
    ``<kind>[<index>].<name>``: those with a copy on another rank, and how many have none, by why."""
    found: list[Replica] = []
    alone: dict[str, int] = {}
    kinds: list[str] = []
    counts: dict[str, int] = {}
    assigned: list[tuple[str, str, nn.Module, Assigned]] = []
    for adapter, wrapper in known if known is not None else wrappers():
        index = counts[adapter.kind] = counts.get(adapter.kind, -1) + 1
        prefix = f"{adapter.kind}[{index}]."
        kinds.append(adapter.kind)
        for replica in adapter.replicas(wrapper):
            if replica.compared:
                found.append(dataclasses.replace(replica, name=prefix + replica.name))
            else:
                alone[replica.alone] = alone.get(replica.alone, 0) + 1
        sharded = adapter.assigned_gradients(wrapper)
        if sharded is not None:
            assigned.append((prefix, adapter.kind, wrapper, sharded))
    return Found(found, alone, sorted(set(kinds)), assigned)
