"""After a loss that raised: the wrapper back to its between-steps state, and ``agree=True``'s one exchange
among the ranks that run the wrapper's step."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .adapters import Adapter
from .errors import RouteStateError

log = logging.getLogger("wrapperroute")


def _recover(adapter: Adapter, wrapper: nn.Module) -> None:
    try:
        adapter.recover(wrapper)
    except Exception:  # never mask the loss's own error; say loudly that the wrapper may be unusable
        log.exception("wrapperroute: could not reset the %s wrapper after a failed step", adapter.kind)


# the ranks that run a wrapper's step -> the side group agreement runs on
_agree_groups: dict[tuple[int, ...], Any] = {}


def _agree(adapter: Adapter, wrapper: nn.Module, error: BaseException | None) -> None:
    """Exchange one success flag with every rank of the wrapper's group; raise if any rank failed.

    On a side group (created once per wrapper group, by its members only), so a rank that failed before one of
    the wrapper's own collectives never pairs this all-reduce with that collective.
    """
    ranks = adapter.step_ranks(wrapper) or tuple(dist.get_process_group_ranks(dist.group.WORLD))
    side = _agree_groups.get(ranks)
    if side is None:
        side = _agree_groups[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    backend = str(dist.get_backend(side))
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
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
