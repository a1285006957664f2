"""After a loss that raised: the wrapper back to its between-steps state, and ``agree=True``'s one exchange
among the ranks that run the wrapper's step."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from ._groups import collective_device, side_group
from .adapters import Adapter
from .errors import RouteStateError

log = logging.getLogger("wrapperroute")


def _recover(adapter: Adapter, wrapper: nn.Module) -> None:
    try:
        adapter.recover(wrapper)
    except Exception:  # never mask the loss's own error; say loudly that the wrapper may be unusable
        log.exception("wrapperroute: could not reset the %s wrapper after a failed step", adapter.kind)


def _agree(adapter: Adapter, wrapper: nn.Module, error: BaseException | None) -> None:
    """Exchange one success flag with every rank of the wrapper's group; raise if any rank failed.

    On a side group (made by the wrapper group's members only, again after the process group is re-created), so
    a rank that failed before one of the wrapper's own collectives never pairs this all-reduce with it.
    """
    ranks = adapter.step_ranks(wrapper) or tuple(range(dist.get_world_size()))
    side = side_group(ranks)
    device = collective_device(side)
    flags = torch.zeros(len(ranks), dtype=torch.int32, device=device)
    flags[ranks.index(dist.get_rank())] = error is not None
    dist.all_reduce(flags, group=side)
    failed = [rank for rank, flag in zip(ranks, flags.tolist(), strict=True) if flag]
    if not failed:
        return
    if error is None:  # our step ran to the end: reset as the failed ranks did, so every rank's state matches
        _recover(adapter, wrapper)
    here = dist.get_rank()
    what = f"{type(error).__name__}: {error}" if error is not None else "none here"
    raise RouteStateError(
        f"route_loss failed on rank(s) {failed} of {list(ranks)} (this is rank {here}; its error: {what}). Every "
        "rank stops here instead of waiting in the backward's collectives; the wrapper is reset and usable. "
        "See the failed ranks' tracebacks for the cause."
    ) from error
