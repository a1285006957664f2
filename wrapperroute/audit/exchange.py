"""Every rank's comparison rows (key, what, coordinate, signature), in one collective once the ranks have
agreed on the rows they compare, and that collective on its way while the caller goes on (``post``, then
``wait``)."""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch
import torch.distributed as dist

Row = tuple[str, str, tuple[int, ...], float]


class SignatureExchange:
    """Each rank sends its row count and a digest of its rows' keys and coordinates, followed by its signatures
    padded to the count agreed at the last exchange of the same ``slot`` (the audit alternates two kinds of
    comparison: gradients only, and gradients with parameters). When every rank's count and digest match that
    agreement, the signatures arrived with them. Otherwise the counts and digests decide, the same on every
    rank: equal among the ranks, a second collective of just the signatures (and a new agreement); unequal,
    the rows themselves, pickled. A collective costs about a millisecond on CPU ranks; pickling, three.
    """

    def __init__(self) -> None:
        self._agreed: dict[object, tuple[int, int]] = {}  # slot -> (rows, digest) every rank sent last time

    def post(self, mine: list[Row], side: Any, slot: object = None) -> Posted:
        """Send ``mine`` (collective on ``side``: every rank posts, then waits, in the same order)."""
        layout = [(key, what, coord) for key, what, coord, _ in mine]
        # 6 bytes: exact in a float64, which carries it beside the signatures
        digest = int.from_bytes(hashlib.blake2b(repr(layout).encode(), digest_size=6).digest(), "little")
        expected = self._agreed.get(slot, (0, -1))
        rows = expected[0]
        sent = torch.full((rows + 2,), math.nan, dtype=torch.float64)
        sent[0], sent[1] = len(mine), digest
        sent[2 : 2 + min(rows, len(mine))] = torch.tensor([sig for *_, sig in mine][:rows], dtype=torch.float64)
        received = [torch.empty_like(sent) for _ in range(dist.get_world_size(side))]
        work = dist.all_gather(received, sent, group=side, async_op=True)
        return Posted(self, slot, side, mine, layout, digest, expected, received, work)


class Posted:
    """One exchange on its way: ``wait()`` gives every rank's rows, in rank order."""

    def __init__(self, exchange: SignatureExchange, slot: object, side: Any, mine: list[Row],
                 layout: list[tuple[str, str, tuple[int, ...]]], digest: int, expected: tuple[int, int],
                 received: list[torch.Tensor], work: Any) -> None:  # fmt: skip
        self.exchange, self.slot, self.side = exchange, slot, side
        self.mine, self.layout, self.digest = mine, layout, digest
        self.expected = expected  # the agreement the signatures were padded to when posted
        self.received, self.work = received, work

    def wait(self) -> list[list[Any]]:
        self.work.wait()
        agreed = self.exchange._agreed
        heads = {(int(r[0]), int(r[1])) for r in self.received}
        if heads == {self.expected}:
            return [_with_signatures(self.layout, r[2:].tolist()) for r in self.received]
        world = len(self.received)
        if len(heads) > 1:  # the ranks compare different rows: every rank's own, pickled
            agreed.pop(self.slot, None)
            everyone: list[Any] = [None] * world
            dist.all_gather_object(everyone, self.mine, group=self.side)
            return everyone
        agreed[self.slot] = (len(self.mine), self.digest)
        signatures = [torch.empty(len(self.mine), dtype=torch.float64) for _ in range(world)]
        mine = torch.tensor([sig for *_, sig in self.mine], dtype=torch.float64)
        dist.all_gather(signatures, mine, group=self.side)
        return [_with_signatures(self.layout, theirs.tolist()) for theirs in signatures]


def _with_signatures(layout: list[tuple[str, str, tuple[int, ...]]], signatures: list[float]) -> list[Any]:
    return [(*row, sig) for row, sig in zip(layout, signatures, strict=True)]
