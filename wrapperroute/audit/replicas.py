"""Which tensors of a process are replicas of other ranks' tensors, and whether the replicas agree.

Found by looking at the distributed wrappers alive in the process (every ``nn.Module`` a distributed adapter
claims: DDP, composable ``replicate``, FSDP2 units, DeepSpeed engines, FSDP1), so it sees the wrappers a
trainer built inside (accelerate, HF ``Trainer``, Lightning, TRL), not only the ones a script names:

- DDP and composable ``replicate``: every parameter and gradient is the same on every rank of its group;
- FSDP2 (and ``replicate`` built on it): a ``DTensor``'s local part is the same on the ranks that share its
  coordinates on the mesh dimensions it is sharded over (HSDP's replicate dimension); plain FSDP2 shards
  every parameter, so there is nothing to compare;
- DeepSpeed ZeRO 0-2: the module's parameters are replicated (compared); its gradients live in the
  optimizer's partitions (not compared). ZeRO-3 and FSDP1 shard by design: not compared.

Each rank sends one cheap signature per tensor (its L2 norm); only tensors whose signatures differ between
replicas are sent whole, to measure the difference. The signature only picks suspects: a difference is
always confirmed on the full tensors.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..adapters import registered
from ..adapters.replicate import _ddp_of
from .exchange import Posted, SignatureExchange

_SEQ = "_wrapperroute_audit_seq"  # creation order of DDP wrappers, stamped by the audit (see session.py)


@dataclass(frozen=True)
class Replica:
    """One tensor that other ranks hold copies of."""

    key: str  # the same on every rank: "<kind>[<index>].<parameter name>"
    kind: str
    param: torch.Tensor
    coord: tuple[int, ...]  # ranks with the same coord hold equal values (and ranks of other groups differ)
    grads: bool  # whether the gradient is replicated too (not for DeepSpeed's partitioned gradients)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _group_coord(group: Any) -> tuple[int, ...]:
    """Ranks of a process group, as a coordinate: replicas are only the ranks of one group."""
    if group is None:
        return ()
    return tuple(dist.get_process_group_ranks(group))


def _dtensor_coord(param: Any) -> tuple[int, ...] | None:
    """This rank's coordinates on the mesh dimensions ``param`` is sharded over (None: not a DTensor, or no
    other rank holds a copy of its local part)."""
    mesh = getattr(param, "device_mesh", None)
    placements = getattr(param, "placements", None)
    if mesh is None or placements is None:
        return None
    coordinate = mesh.get_coordinate() or []
    sharded = [dim for dim, placement in enumerate(placements) if placement.is_shard()]
    if math.prod(mesh.size(dim) for dim in range(mesh.ndim) if dim not in sharded) < 2:
        return None  # sharded over every rank of its mesh: no other rank holds a copy
    # A mesh the process holds several of (two models): its rank layout, so replicas of one mesh only match.
    return (*mesh.mesh.flatten().tolist(), -1, *(coordinate[dim] for dim in sharded))


def wrappers() -> list[tuple[str, nn.Module]]:
    """Every distributed wrapper alive in this process (outermost only), in an order the same on every rank:
    DDP wrappers by creation, the rest by kind and structure."""
    adapters = [adapter for adapter in registered() if adapter.distributed]
    found: list[tuple[str, nn.Module]] = []
    for obj in gc.get_objects():
        if issubclass(type(obj), nn.Module):  # type(), not isinstance: proxies warn when asked their class
            for adapter in adapters:
                if adapter.claims(obj):
                    found.append((adapter.kind, obj))
                    break
    inner = {id(sub) for _, wrapper in found for sub in wrapper.modules() if sub is not wrapper}
    # composable replicate() keeps a DistributedDataParallel of its own over the same parameters
    inner |= {id(_ddp_of(wrapper)) for kind, wrapper in found if kind == "replicate"}
    outer = [(kind, wrapper) for kind, wrapper in found if id(wrapper) not in inner]

    def order(item: tuple[str, nn.Module]) -> tuple[Any, ...]:
        kind, wrapper = item
        shapes = tuple((name, tuple(p.shape)) for name, p in wrapper.named_parameters())
        return (kind, getattr(wrapper, _SEQ, 0), shapes)

    return sorted(outer, key=order)


def replicas(known: list[tuple[str, nn.Module]] | None = None) -> tuple[list[Replica], list[str]]:
    """The replicated tensors of every wrapper (of ``known``, else of every wrapper alive), and the kinds of
    wrappers found (sharded ones included)."""
    found: list[Replica] = []
    kinds: list[str] = []
    counts: dict[str, int] = {}
    for kind, wrapper in known if known is not None else wrappers():
        index = counts[kind] = counts.get(kind, -1) + 1
        kinds.append(kind)
        if kind in ("ddp", "replicate"):
            group = getattr(wrapper, "process_group", None) if kind == "ddp" else None
            module: nn.Module = wrapper.module if kind == "ddp" else wrapper  # type: ignore[assignment]
            coord = _group_coord(group)
            for name, param in module.named_parameters():
                if param.requires_grad:
                    found.append(Replica(f"{kind}[{index}].{name}", kind, param, coord, True))
        elif kind in ("fsdp2", "replicate_fsdp"):
            for name, param in wrapper.named_parameters():
                coord_or_none = _dtensor_coord(param)
                if coord_or_none is not None and param.requires_grad:
                    found.append(Replica(f"{kind}[{index}].{name}", kind, param, coord_or_none, True))
        elif kind == "deepspeed" and wrapper.zero_optimization_stage() < 3:  # type: ignore[operator]
            for name, param in wrapper.module.named_parameters():  # type: ignore[union-attr]
                if param.requires_grad:
                    found.append(Replica(f"{kind}[{index}].{name}", kind, param, (), False))
    return found, sorted(set(kinds))


# Tensors smaller than this are always read whole: a window saves nothing there.
_WINDOW_MIN = 1 << 16


def _part(tensor: torch.Tensor | None, window: tuple[int, int] | None) -> torch.Tensor | None:
    """Part ``part`` of ``parts`` contiguous parts of ``tensor`` (flattened), or all of it."""
    if tensor is None or window is None or tensor.numel() < _WINDOW_MIN or not tensor.is_contiguous():
        return tensor
    part, parts = window
    size = -(-tensor.numel() // parts)
    return tensor.view(-1)[part * size : (part + 1) * size]


def _signatures(tensors: list[torch.Tensor | None]) -> list[float]:
    present = [t.detach() for t in tensors if t is not None]
    norms = iter(torch._foreach_norm([t.float() if t.dtype != torch.float32 else t for t in present]) if present
                 else [])  # fmt: skip
    return [float(next(norms)) if t is not None else math.nan for t in tensors]


@dataclass(frozen=True)
class Difference:
    key: str
    what: str  # "gradient" or "parameter"
    max_abs_diff: float


def compare(
    found: list[Replica], side: Any, grads_of: set[int] | None, params: bool = True,
    exchange: SignatureExchange | None = None, window: tuple[int, int] | None = None,
) -> tuple[int, list[Difference]]:  # fmt: skip
    """Compare every replica with its copies on the other ranks (collective on ``side``, every rank calls it
    with the same keys). ``grads_of``: ids of the parameters whose gradients are compared now (None: no
    gradient); ``params``: compare the parameters too (always, for replicas whose gradients are not compared);
    ``exchange``: the run's, so that a comparison like the last one costs one collective; ``window``
    ``(part, parts)``: the gradients' signatures read only that part of each large gradient (a suspect is still
    compared whole). Returns how many tensors were compared and the differences, worst first."""
    return compare_later(found, side, grads_of, params, exchange, window).result()


def compare_later(
    found: list[Replica], side: Any, grads_of: set[int] | None, params: bool = True,
    exchange: SignatureExchange | None = None, window: tuple[int, int] | None = None,
) -> Comparison:  # fmt: skip
    """:func:`compare`, its signatures read now and sent on their way: ``result()`` receives them, and sends
    the suspects whole. Whatever runs in between (the optimizer's step) overlaps the exchange; a suspect's
    tensor is read whole when ``result()`` runs (a gradient is unchanged by a step, a parameter updated)."""
    rows: list[tuple[str, str, torch.Tensor | None]] = []
    for replica in found:
        if params or not replica.grads:
            rows.append((replica.key, "parameter", _local(replica.param)))
        if grads_of is not None and replica.grads and id(replica.param) in grads_of:
            grad = replica.param.grad
            rows.append((replica.key, "gradient", _local(grad) if grad is not None else None))
    signatures = _signatures([_part(tensor, window) if what == "gradient" else tensor for _, what, tensor in rows])
    coords = {replica.key: replica.coord for replica in found}
    mine = [(key, what, coords[key], sig) for (key, what, _), sig in zip(rows, signatures, strict=True)]
    return Comparison(rows, (exchange or SignatureExchange()).post(mine, side, slot=params), side)


@dataclass
class Comparison:
    """A comparison whose signatures are on their way (:func:`compare_later`)."""

    rows: list[tuple[str, str, torch.Tensor | None]]
    posted: Posted
    side: Any

    def result(self) -> tuple[int, list[Difference]]:
        """How many tensors were compared and the differences, worst first (collective: every rank calls it)."""
        everyone = self.posted.wait()
        suspects = _suspects(everyone)
        payload = {(key, what): tensor for key, what, tensor in self.rows if (key, what) in suspects}
        differences: list[Difference] = []
        if suspects:  # every rank computed the same suspect set from the same gathered signatures
            tensors: list[Any] = [None] * dist.get_world_size(self.side)
            sent = {k: (v.detach().float().cpu() if v is not None else None) for k, v in payload.items()}
            dist.all_gather_object(tensors, sent, group=self.side)
            for key, what in sorted(suspects):
                worst = _max_diff([(everyone[r], tensors[r]) for r in range(len(everyone))], key, what)
                if worst > 0:
                    differences.append(Difference(key, what, worst))
        differences.sort(key=lambda d: -d.max_abs_diff)
        return len(self.rows), differences


def _suspects(everyone: list[list[tuple[str, str, tuple[int, ...], float]]]) -> set[tuple[str, str]]:
    seen: dict[tuple[str, str, tuple[int, ...]], float] = {}
    suspects: set[tuple[str, str]] = set()
    for rows in everyone:
        for key, what, coord, signature in rows:
            first = seen.setdefault((key, what, coord), signature)
            if not (first == signature or (math.isnan(first) and math.isnan(signature))):
                suspects.add((key, what))
    return suspects


def _max_diff(ranks: list[tuple[list[Any], dict[Any, Any]]], key: str, what: str) -> float:
    by_coord: dict[tuple[int, ...], list[torch.Tensor | None]] = {}
    for rows, tensors in ranks:
        coord = next((c for k, w, c, _ in rows if k == key and w == what), None)
        if coord is None:  # this rank holds no such tensor (its key list differs): nothing of it to compare
            continue
        by_coord.setdefault(coord, []).append(tensors.get((key, what)))
    worst = 0.0
    for copies in by_coord.values():
        first = copies[0]
        for other in copies[1:]:
            if first is None or other is None:
                worst = max(worst, math.inf if (first is None) != (other is None) else 0.0)
            elif first.shape != other.shape:
                worst = math.inf
            else:
                worst = max(worst, float((first - other).abs().max()) if first.numel() else 0.0)
    return worst
