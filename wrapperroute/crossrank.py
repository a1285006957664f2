"""Every comparison of tensors across ranks, written once: ``check_grad_sync``, the audit and ``wrapperroute check``
go through here.

- **Which ranks**: a row names the ranks that must hold a copy equal to this rank's (``copies``): a DDP's process
  group, one dimension of a device mesh, DeepSpeed's data-parallel group (the adapters say which, see
  ``Topology.replicas``). Rows are exchanged over a group that spans them all, and compared only among copies.
- **Exactly**: each rank sends a signature per tensor (its L2 norm, accumulated in the tensor's own precision
  or better); a tensor whose signature differs among its copies, or is not finite, is a *suspect* and is sent
  whole, as its raw bytes (dtype and every bit kept), and compared in float64, which holds every value of
  every floating dtype exactly. Equal norms of different tensors is the blind spot of signatures:
  ``whole=True`` sends every tensor whole.
- **Non-finite values are values**: NaN beside a number differs; NaN beside NaN, and an infinity beside the
  same infinity, do not, but such tensors are reported as non-finite.
- **Nothing undeclared**: no ``all_gather_object`` (it needs numpy, which torch does not depend on); rows travel
  as JSON in a byte tensor, suspects as their raw bytes (``all_gather_bytes``).
- **Over groups of our own** where the caller asks (``_groups.side_group``, shared with ``agree=True``'s flag
  exchange), made again when the default group is.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from ._groups import collective_device
from ._torch_internals import foreach_norm

if TYPE_CHECKING:
    from .adapters import Replica

__all__ = [
    "Exchange",
    "Mismatch",
    "Outcome",
    "Pending",
    "Row",
    "compare",
    "compare_later",
    "local_part",
    "replica_rows",
    "what_of",
]


# --- rows and signatures ---------------------------------------------------------------------------------------

_ABSENT = -1  # the numel sent for a tensor this rank does not hold (a gradient that is None)


@dataclass(frozen=True)
class Row:
    """One tensor to compare: ``key`` is the same on every rank holding a copy; ``copies`` the global ranks whose
    copy must equal this rank's (this rank included; the same tuple on each of them); ``tensor`` None: absent on
    this rank (a gradient never computed). ``window``: the part of it the signature reads, ``(part, parts)``."""

    key: str
    tensor: torch.Tensor | None
    copies: tuple[int, ...]
    window: tuple[int, int] | None = None


_WHAT = ("gradient", "parameter")


def replica_rows(
    replicas: Sequence[Replica], *, params: bool = True, grads_of: set[int] | None = None,
    window: tuple[int, int] | None = None,
) -> list[Row]:  # fmt: skip
    """The rows that compare replicas: ``"parameter <name>"`` for each (when ``params``, and always for one whose
    gradient is not replicated), ``"gradient <name>"`` for each whose parameter's ``id`` is in ``grads_of`` (a
    gradient that is None is absent on this rank); ``window``: the part of each large gradient its signature reads.
    A replica no other rank holds a copy of is not compared."""
    rows: list[Row] = []
    for replica in replicas:
        if not replica.compared:
            continue
        if params or not replica.grads:
            rows.append(Row(f"parameter {replica.name}", local_part(replica.param), replica.copies))
        if grads_of is not None and replica.grads and id(replica.param) in grads_of:
            grad = replica.param.grad
            rows.append(Row(f"gradient {replica.name}", local_part(grad) if grad is not None else None, replica.copies,
                            window))  # fmt: skip
    return rows


def what_of(key: str) -> tuple[str, str]:
    """``(what, name)`` of a row's key: ``("gradient", "ddp[0].w")`` for ``"gradient ddp[0].w"``."""
    head, _, rest = key.partition(" ")
    return (head, rest) if head in _WHAT and rest else ("tensor", key)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """A ``DTensor``'s local part; any other tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


# Tensors smaller than this are always signed whole: a window saves nothing there.
WINDOW_MIN = 1 << 16


def _part(tensor: torch.Tensor, window: tuple[int, int] | None) -> torch.Tensor:
    if window is None or tensor.numel() < WINDOW_MIN or not tensor.is_contiguous():
        return tensor
    part, parts = window
    size = -(-tensor.numel() // parts)
    return tensor.view(-1)[part * size : (part + 1) * size]


def signatures(rows: Sequence[Row]) -> list[float]:
    """Each row's L2 norm (of its window), in the tensor's precision (float32 at least: half and bfloat16 are
    accumulated in float32, with no widened copy); NaN for an absent tensor. One fused kernel per device and
    dtype."""
    out = [math.nan] * len(rows)
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[int, torch.Tensor]]] = {}
    for index, row in enumerate(rows):
        if row.tensor is not None:
            tensor = _part(row.tensor.detach(), row.window)
            if not tensor.is_floating_point():
                tensor = tensor.double()  # an integer tensor: every value exact in float64
            groups.setdefault((tensor.device, tensor.dtype), []).append((index, tensor))
    for (_, dtype), members in groups.items():
        wide = dtype if dtype in (torch.float32, torch.float64) else torch.float32
        norms = torch.stack(foreach_norm([tensor for _, tensor in members], wide)).tolist()  # one read back
        for (index, _), norm in zip(members, norms, strict=True):
            out[index] = norm
    return out


def _dtype_code(tensor: torch.Tensor | None) -> str:
    return "" if tensor is None else str(tensor.dtype).removeprefix("torch.")


class Sent(NamedTuple):
    """A row as another rank sent it."""

    key: str
    copies: tuple[int, ...]
    signature: float
    numel: int  # _ABSENT: the rank does not hold it
    dtype: str


class Exchange:
    """Every rank's rows, in as few collectives as the rows allow.

    Each rank sends a head (its row count, a digest of its rows' keys, copies, sizes and dtypes, and the length
    of those rows as JSON) and its signatures, padded to the longest row count agreed at the last exchange of the
    same ``slot``. When every rank's head is the one it sent last time, the signatures arrived with the heads:
    one collective. Otherwise every rank's rows follow as JSON bytes: one more. An exchange is posted (its first
    collective on its way, ``async_op``) and finished later, so the caller can overlap it with its own work."""

    def __init__(self) -> None:
        # slot -> (every rank's head, every rank's layout) as of the last exchange that sent the rows
        self._agreed: dict[object, tuple[list[tuple[int, int, int]], list[list[tuple[Any, ...]]]]] = {}

    def post(self, rows: Sequence[Row], group: Any, slot: object = None) -> Posted:
        """Start the exchange of ``rows`` (collective on ``group``: every rank posts, then finishes, in the same
        order)."""
        device = collective_device(group)
        sigs = signatures(rows)
        layout = [(row.key, list(row.copies), _numel(row.tensor), _dtype_code(row.tensor)) for row in rows]
        text = json.dumps(layout, separators=(",", ":")).encode()
        # 6 bytes: exact in a float64, which carries it beside the signatures
        digest = int.from_bytes(hashlib.blake2b(text, digest_size=6).digest(), "little")
        heads, _ = self._agreed.get(slot, ([], []))
        width = max((count for count, _, _ in heads), default=0)
        sent = torch.full((width + 3,), math.nan, dtype=torch.float64)
        sent[0], sent[1], sent[2] = len(rows), digest, len(text)
        sent[3 : 3 + min(width, len(rows))] = torch.tensor(sigs[:width], dtype=torch.float64)
        sent = sent.to(device)
        received = [torch.empty_like(sent) for _ in range(dist.get_world_size(group))]
        work = dist.all_gather(received, sent, group=group, async_op=True)
        return Posted(exchange=self, slot=slot, group=group, device=device, sigs=sigs, layout=layout, text=text,
                      received=received, work=work)  # fmt: skip


def _numel(tensor: torch.Tensor | None) -> int:
    return _ABSENT if tensor is None else tensor.numel()


@dataclass
class Posted:
    """An exchange on its way: :meth:`rows` gives every rank's rows, in rank order."""

    exchange: Exchange
    slot: object
    group: Any
    device: torch.device
    sigs: list[float]
    layout: list[tuple[Any, ...]]
    text: bytes
    received: list[torch.Tensor]
    work: Any

    def rows(self) -> list[list[Sent]]:
        self.work.wait()
        received = [tensor.cpu().tolist() for tensor in self.received]
        heads = [(int(r[0]), int(r[1]), int(r[2])) for r in received]
        agreed = self.exchange._agreed
        known_heads, layouts = agreed.get(self.slot, ([], []))
        if heads == known_heads:  # the signatures came with the heads
            signed = [values[3 : 3 + count] for values, (count, _, _) in zip(received, heads, strict=True)]
        else:  # some rank's rows changed: every rank's signatures and rows (their lengths are in the heads)
            mine = tensor_bytes(torch.tensor(self.sigs, dtype=torch.float64)) + self.text
            sizes = [8 * count + length for count, _, length in heads]
            payloads = all_gather_bytes(mine, self.group, self.device, sizes)
            signed, layouts = [], []
            for payload, (count, _, _) in zip(payloads, heads, strict=True):
                floats = torch.frombuffer(bytearray(payload[: 8 * count]), dtype=torch.float64) if count else None
                signed.append(floats.tolist() if floats is not None else [])
                layouts.append([tuple(row) for row in json.loads(payload[8 * count :])])
            agreed[self.slot] = (heads, layouts)
        return [
            [Sent(key, tuple(copies), float(sig), int(numel), dtype)
             for (key, copies, numel, dtype), sig in zip(layout, sigs, strict=True)]
            for layout, sigs in zip(layouts, signed, strict=True)
        ]  # fmt: skip


# --- comparing -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mismatch:
    """A tensor whose copies differ. ``max_abs_diff``: the largest difference between copies over the elements
    finite on both (``inf`` when a copy's tensor is absent, a gradient None on that rank, or its element count or
    dtype differs: shapes are not sent, tensors of one element count are compared flat; a key that no other rank
    sends has nothing to be compared with and is not compared); ``nonfinite``: elements
    non-finite on some copy and not the same on another (NaN beside a number)."""

    key: str
    max_abs_diff: float
    nonfinite: int = 0

    @property
    def what(self) -> str:
        """``"gradient"`` or ``"parameter"`` for a replica's row (see :func:`replica_rows`), else ``"tensor"``."""
        return what_of(self.key)[0]

    @property
    def name(self) -> str:
        """The tensor's name, without what it is."""
        return what_of(self.key)[1]

    def describe(self) -> str:
        """The difference as a table shows it."""
        if math.isinf(self.max_abs_diff):
            return "missing"
        if self.nonfinite:
            return f"nan/inf x{self.nonfinite}" + (f", {self.max_abs_diff:.3g}" if self.max_abs_diff else "")
        return f"{self.max_abs_diff:.3g}"

    @property
    def severity(self) -> tuple[bool, float]:
        return (self.nonfinite > 0 or math.isinf(self.max_abs_diff), self.max_abs_diff)


@dataclass
class Outcome:
    """What a comparison found: ``compared`` rows on this rank, the ``mismatches`` (worst first), and the keys of
    tensors non-finite identically on every copy (``nonfinite``: not a desync, but worth saying)."""

    compared: int
    mismatches: list[Mismatch] = field(default_factory=list)
    nonfinite: list[str] = field(default_factory=list)


def _suspects(everyone: list[list[Sent]], whole: bool) -> list[str]:
    """Keys whose copies may differ (a signature, size, dtype or presence differs among ranks with the same
    copies, or a signature is not finite); every rank computes the same list from the same rows."""
    seen: dict[tuple[str, tuple[int, ...]], tuple[float, int, str]] = {}
    suspects: set[str] = set()
    for rows in everyone:
        for row in rows:
            if whole or not math.isfinite(row.signature):
                suspects.add(row.key)
                continue
            first = seen.setdefault((row.key, row.copies), (row.signature, row.numel, row.dtype))
            if first != (row.signature, row.numel, row.dtype):
                suspects.add(row.key)
    return sorted(suspects)


def _itemsize(dtype: str) -> int:
    return int(torch.empty((), dtype=getattr(torch, dtype)).element_size())


def _aligned(size: int) -> int:
    return -(-size // 8) * 8


def _measure(
    suspects: list[str], everyone: list[list[Sent]], mine: dict[str, torch.Tensor | None], group: Any,
    device: torch.device,
) -> Outcome:  # fmt: skip
    """Send every suspect whole (its bytes), then compare the copies of each, as values."""
    order = {key: index for index, key in enumerate(suspects)}
    held: list[dict[str, tuple[tuple[int, ...], int, str]]] = [
        {row.key: (row.copies, row.numel, row.dtype) for row in rows if row.key in order} for rows in everyone
    ]

    def nbytes(entry: tuple[tuple[int, ...], int, str]) -> int:
        _, numel, dtype = entry
        return _aligned(numel * _itemsize(dtype)) if numel > 0 else 0

    sizes = [sum(nbytes(entry) for entry in rank.values()) for rank in held]
    longest = max(sizes, default=0)
    sent = torch.zeros(longest, dtype=torch.uint8, device=device)
    offset = 0
    me = dist.get_rank(group) if group is not None else dist.get_rank()
    for key in suspects:
        entry = held[me].get(key)
        tensor = mine.get(key)
        if entry is None or tensor is None or entry[1] <= 0:
            continue
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).to(device)
        sent[offset : offset + raw.numel()] = raw
        offset += nbytes(entry)
    received = [torch.empty_like(sent) for _ in range(len(held))]
    if longest:
        dist.all_gather(received, sent, group=group)
    copies_of: list[dict[str, torch.Tensor | None]] = []
    for rank, buffer in zip(held, received, strict=True):
        tensors: dict[str, torch.Tensor | None] = {}
        offset = 0
        for key in suspects:
            entry = rank.get(key)
            if entry is None:
                continue
            _, numel, dtype = entry
            if numel < 0:
                tensors[key] = None
                continue
            size = numel * _itemsize(dtype)
            tensors[key] = buffer[offset : offset + size].cpu().view(getattr(torch, dtype))
            offset += nbytes(entry)
        copies_of.append(tensors)
    outcome = Outcome(compared=len(everyone[me]))
    for key in suspects:
        groups: dict[tuple[int, ...], list[torch.Tensor | None]] = {}
        for rank, tensors in zip(held, copies_of, strict=True):
            if key in rank:
                groups.setdefault(rank[key][0], []).append(tensors[key])
        worst: Mismatch | None = None
        nonfinite = False
        for members in groups.values():
            first = members[0]
            nonfinite = nonfinite or (first is not None and not bool(torch.isfinite(first).all()))
            for other in members[1:]:
                found = _mismatch(key, first, other)
                if found is not None and (worst is None or found.severity > worst.severity):
                    worst = found
        if worst is not None:
            outcome.mismatches.append(worst)
        elif nonfinite:
            outcome.nonfinite.append(key)
    outcome.mismatches.sort(key=lambda m: m.severity, reverse=True)
    return outcome


def _mismatch(key: str, a: torch.Tensor | None, b: torch.Tensor | None) -> Mismatch | None:
    """How two copies differ, as values (float64 holds every value of every floating dtype exactly)."""
    if a is None or b is None:
        return None if a is None and b is None else Mismatch(key, math.inf)
    if a.shape != b.shape or a.dtype != b.dtype:
        return Mismatch(key, math.inf)
    a64, b64 = a.double(), b.double()
    same = (a64 == b64) | (torch.isnan(a64) & torch.isnan(b64))
    if bool(same.all()):
        return None
    finite = torch.isfinite(a64) & torch.isfinite(b64)
    differing = ~same
    finite_diffs = (a64 - b64).abs()[differing & finite]
    largest = float(finite_diffs.max()) if finite_diffs.numel() else 0.0
    return Mismatch(key, largest, int((differing & ~finite).sum()))


@dataclass
class Pending:
    """A comparison whose signatures are on their way: :meth:`result` finishes it (collective)."""

    posted: Posted
    tensors: dict[str, torch.Tensor | None]
    whole: bool

    def result(self) -> Outcome:
        everyone = self.posted.rows()
        suspects = _suspects(everyone, self.whole)
        if not suspects:
            return Outcome(compared=len(self.tensors))
        return _measure(suspects, everyone, self.tensors, self.posted.group, self.posted.device)


def compare_later(
    rows: Sequence[Row], group: Any = None, *, exchange: Exchange | None = None, slot: object = None,
    whole: bool = False,
) -> Pending:  # fmt: skip
    """:func:`compare`, posted: the signatures are read now and travel while the caller goes on; a suspect's
    tensor is read whole when :meth:`Pending.result` runs."""
    keys = [row.key for row in rows]
    if len(set(keys)) != len(keys):
        raise ValueError("crossrank.compare: every row needs a key of its own")
    posted = (exchange or Exchange()).post(rows, group, slot)
    return Pending(posted, {row.key: row.tensor for row in rows}, whole)


def compare(rows: Sequence[Row], group: Any = None, *, whole: bool = False) -> Outcome:
    """Compare each row's tensor with its copies on the ranks its ``copies`` name (collective on ``group``,
    which must hold every rank named; every rank calls it). ``whole``: every tensor sent whole, not only those
    whose signatures differ."""
    return compare_later(rows, group, whole=whole).result()


# --- the byte exchange ---------------------------------------------------------------------------------------


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
