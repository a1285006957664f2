"""How each sharded parameter's gradient arrived: through its wrapper's own reduction, or around it.

FSDP2 assigns a sharded parameter's gradient itself, after its reduce-scatter (``sharded_param.grad = ...``, then
the post-accumulate-grad hooks, which it calls by hand): autograd never computes a gradient for the sharded
parameter, since a loss inside its unit's forward reads the unsharded parameter that forward gathered. Autograd
computing one means the loss read the sharded parameter outside that forward (``weight.full_tensor()``,
``redistribute``: TRL's fused LM head on a head in its own FSDP2 unit), and the gradient came back through
DTensor's redistribution instead: each rank's own, never reduced over the data-parallel ranks, identical on every
rank and wrong. A tensor hook (``Tensor.register_hook``) on the sharded parameter fires exactly then, and never for
FSDP2's own assignment (measured on every FSDP2 layout the tests build, torch 2.13).

- **Watching** registers one hook per parameter, once per process, whoever asks (the audit, ``check_grad_sync``,
  ``guard``, ``wrapperroute check``): it counts, and costs nothing on FSDP2's own path, where it never fires.
- **Looking** (:meth:`Watch.look`) tells, per watched parameter, whether autograd computed a gradient for it since
  the last look, and whether it holds a gradient at all: the ranks then agree on what they saw
  (:func:`agree`), so every rank reaches the same verdict.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.hooks import unserializable_hook

from ._groups import collective_device
from .crossrank import all_gather_bytes

__all__ = ["Arrivals", "Bypass", "Watch", "agree", "watch"]

# id(parameter) -> how many times autograd computed a gradient for it (its entry leaves with the parameter)
_autograd_grads: dict[int, list[int]] = {}


def watch(params: Iterable[torch.Tensor]) -> None:
    """Count, from now on, each time autograd computes a gradient for one of ``params`` (once per parameter; a
    frozen one is left alone)."""
    for param in params:
        key = id(param)
        if key in _autograd_grads or not param.requires_grad:
            continue
        count = [0]

        @unserializable_hook  # torch.save of the parameter need not say it holds a hook
        def counted(grad: torch.Tensor, count: list[int] = count) -> None:
            count[0] += 1

        param.register_hook(counted)
        _autograd_grads[key] = count
        weakref.finalize(param, _autograd_grads.pop, key, None)


@dataclass(frozen=True)
class Bypass:
    """A gradient that reached a sharded parameter around its wrapper's reduction: the parameter's ``name`` (the
    audit's prefix included), the wrapper's ``kind``, ``how`` it arrived, and the global ``ranks`` where it did."""

    name: str
    kind: str
    how: str
    ranks: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.name} ({self.how})"


@dataclass(frozen=True)
class Arrivals:
    """What a look found, the same on every rank: ``verified`` gradients that came through their wrapper's own
    reduction (the most on any rank), and the ``bypassed`` ones."""

    verified: int = 0
    bypassed: tuple[Bypass, ...] = ()

    def __add__(self, other: Arrivals) -> Arrivals:
        return Arrivals(self.verified + other.verified, self.bypassed + other.bypassed)


class Watch:
    """The sharded parameters of one wrapper (``named``: name and parameter), whose gradients its ``reduction``
    assigns; ``kind`` the wrapper's. Watched from the moment it is made."""

    def __init__(self, kind: str, reduction: str, named: list[tuple[str, torch.Tensor]]) -> None:
        self.kind = kind
        self.reduction = reduction
        self._named = [(name, weakref.ref(param)) for name, param in named]
        # Parameters watched since before this watch (from their wrapper's making on) are seen from then; any
        # other's gradient may have arrived unseen, so the first look verifies nothing.
        self.watching_since_start = all(id(param) in _autograd_grads for _, param in named)
        watch(param for _, param in named)
        self._seen = {name: 0 if self.watching_since_start else _autograd_grads.get(id(param), [0])[0]
                      for name, param in named}  # fmt: skip
        self._looked = self.watching_since_start

    def __len__(self) -> int:
        return len(self._named)

    def look(self) -> tuple[int, list[str]]:
        """Since the last look: how many watched parameters hold a gradient that came only through the reduction,
        and the names of those for which autograd computed one."""
        verified, bypassed = 0, []
        first, self._looked = not self._looked, True
        for name, ref in self._named:
            param = ref()
            if param is None:
                continue
            count = _autograd_grads.get(id(param), [0])[0]
            if count != self._seen[name]:
                bypassed.append(name)
            elif param.grad is not None and not first:
                verified += 1
            self._seen[name] = count
        return verified, bypassed

    def how(self) -> str:
        """How a bypassed gradient arrived, in words."""
        return f"autograd through the sharded parameter, read outside its unit's forward; not {self.reduction}"


def agree(looks: list[tuple[Watch, str, tuple[int, list[str]]]], group: Any) -> Arrivals:
    """Every rank's looks (each: the watch, the prefix of its names, what it saw), exchanged over ``group``
    (collective: every rank of it calls, with its own looks, possibly none): the same :class:`Arrivals` on every
    rank. A bypass on any rank is one on every rank's report."""
    mine = {
        "verified": sum(verified for _, _, (verified, _) in looks),
        "bypassed": [[prefix + name, watch.kind, watch.how()] for watch, prefix, (_, names) in looks for name in names],
    }
    payloads = all_gather_bytes(json.dumps(mine).encode(), group, collective_device(group))
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    verified = 0
    where: dict[tuple[str, str, str], list[int]] = {}
    for rank, payload in zip(ranks, payloads, strict=True):
        theirs = json.loads(payload)
        verified = max(verified, int(theirs["verified"]))
        for name, kind, how in theirs["bypassed"]:
            where.setdefault((name, kind, how), []).append(rank)
    bypassed = tuple(Bypass(name, kind, how, tuple(at)) for (name, kind, how), at in sorted(where.items()))
    return Arrivals(verified, bypassed)
