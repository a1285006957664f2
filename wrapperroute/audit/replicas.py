"""Which tensors of a process are replicas of other ranks' tensors, and whether the replicas agree.

Found by looking at the distributed wrappers alive in the process (every ``nn.Module`` a distributed adapter
claims: DDP, composable ``replicate``, FSDP2 units, DeepSpeed engines, FSDP1), so it sees the wrappers a
trainer built inside (accelerate, HF ``Trainer``, Lightning, TRL), not only the ones a script names. Which of
their tensors are replicated, and over which ranks, each wrapper's adapter says (``Adapter.replicas``: DDP's
process group, ``replicate``'s mesh dimension, an HSDP mesh's replicate dimension, DeepSpeed's data-parallel
group); two data-parallel groups in one job are compared each within itself. The comparison itself is
``wrapperroute.crossrank``'s: a signature per tensor, suspects sent whole, values compared NaN-aware.
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import crossrank
from ..adapters import Adapter, registered
from ..adapters.base import Replica
from ..crossrank import Exchange, Mismatch, Pending, Row

_SEQ = "_wrapperroute_audit_seq"  # creation order of DDP wrappers, stamped by the audit (see session.py)


def wrappers() -> list[tuple[Adapter, nn.Module]]:
    """Every distributed wrapper alive in this process (outermost only), in an order the same on every rank:
    DDP wrappers by creation, the rest by kind and structure."""
    adapters = [adapter for adapter in registered() if isinstance(adapter, Adapter) and adapter.distributed]
    found: list[tuple[Adapter, nn.Module]] = []
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

    def order(item: tuple[Adapter, nn.Module]) -> tuple[Any, ...]:
        adapter, wrapper = item
        shapes = tuple((name, tuple(p.shape)) for name, p in wrapper.named_parameters())
        return (adapter.kind, getattr(wrapper, _SEQ, 0), shapes)

    return sorted(outer, key=order)


@dataclass(frozen=True)
class Found:
    """The replicas of every wrapper: those with copies to compare, and by why, the count of those without."""

    replicas: list[Replica]
    alone: dict[str, int]
    kinds: list[str]


def replicas(known: list[tuple[Adapter, nn.Module]] | None = None) -> Found:
    """The trainable parameters of every wrapper (of ``known``, else of every wrapper alive), each named
    ``<kind>[<index>].<name>``: those with a copy on another rank, and how many have none, by why."""
    found: list[Replica] = []
    alone: dict[str, int] = {}
    kinds: list[str] = []
    counts: dict[str, int] = {}
    for adapter, wrapper in known if known is not None else wrappers():
        index = counts[adapter.kind] = counts.get(adapter.kind, -1) + 1
        kinds.append(adapter.kind)
        for replica in adapter.replicas(wrapper):
            if replica.compared:
                found.append(dataclasses.replace(replica, name=f"{adapter.kind}[{index}].{replica.name}"))
            else:
                alone[replica.alone] = alone.get(replica.alone, 0) + 1
    return Found(found, alone, sorted(set(kinds)))


@dataclass(frozen=True)
class Difference:
    key: str
    what: str  # "gradient" or "parameter"
    max_abs_diff: float  # over values finite on both copies; inf: absent on some rank
    nonfinite: int = 0  # values NaN or inf on one copy and not the same on another

    def describe(self) -> str:
        return Mismatch(self.key, self.max_abs_diff, self.nonfinite).describe()


@dataclass(frozen=True)
class Finding:
    """One comparison's result: tensors compared, those that differ (worst first), those non-finite alike on
    every copy (``nonfinite``, as ``(key, what)``)."""

    compared: int
    differences: list[Difference]
    nonfinite: list[tuple[str, str]]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def compare(
    found: list[Replica], side: Any, grads_of: set[int] | None, params: bool = True,
    exchange: Exchange | None = None, window: tuple[int, int] | None = None,
) -> Finding:  # fmt: skip
    """Compare every replica with its copies on the other ranks (collective on ``side``, every rank calls it).
    ``grads_of``: ids of the parameters whose gradients are compared now (None: no gradient); ``params``: compare
    the parameters too (always, for replicas whose gradients are not compared); ``exchange``: the run's, so that
    a comparison like the last one costs one collective; ``window`` ``(part, parts)``: the gradients'
    signatures read only that part of each large gradient (a suspect is still compared whole)."""
    return compare_later(found, side, grads_of, params, exchange, window).result()


def compare_later(
    found: list[Replica], side: Any, grads_of: set[int] | None, params: bool = True,
    exchange: Exchange | None = None, window: tuple[int, int] | None = None,
) -> Comparison:  # fmt: skip
    """:func:`compare`, its signatures read now and sent on their way: ``result()`` receives them, and sends
    the suspects whole. Whatever runs in between (the optimizer's step) overlaps the exchange; a suspect's
    tensor is read whole when ``result()`` runs (a gradient is unchanged by a step, a parameter updated)."""
    rows: list[Row] = []
    for replica in found:
        if params or not replica.grads:
            rows.append(Row(f"parameter {replica.name}", _local(replica.param), replica.copies))
        if grads_of is not None and replica.grads and id(replica.param) in grads_of:
            grad = replica.param.grad
            rows.append(Row(f"gradient {replica.name}", _local(grad) if grad is not None else None, replica.copies,
                            window))  # fmt: skip
    # two kinds of comparison alternate (gradients alone, gradients with parameters): each its own slot
    return Comparison(crossrank.compare_later(rows, side, exchange=exchange, slot=params))


@dataclass
class Comparison:
    """A comparison whose signatures are on their way (:func:`compare_later`)."""

    pending: Pending

    def result(self) -> Finding:
        """What was found (collective: every rank calls it)."""
        outcome = self.pending.result()
        differences = []
        for mismatch in outcome.mismatches:
            what, key = mismatch.key.split(" ", 1)
            differences.append(Difference(key, what, mismatch.max_abs_diff, mismatch.nonfinite))
        nonfinite = [(key, what) for what, key in (entry.split(" ", 1) for entry in outcome.nonfinite)]
        return Finding(outcome.compared, differences, nonfinite)
