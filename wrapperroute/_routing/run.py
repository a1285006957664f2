"""Running a routed call: enter the wrapper with it (``swap.enter``); after a fault, the wrapper back to its
between-steps state; the functorch fallback (a compiled ``torch.func`` loss that DDP's graph optimizer cannot
split is run once more isolated from that optimizer, ``adapters/ddp.py``, and stays isolated for the process);
``agree=True``'s one exchange among the ranks that run the wrapper's step."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .._groups import collective_device, side_group
from .._torch_internals import enable_saved_tensor_hooks, saved_tensor_hooks_enabled
from ..adapters import Isolating, Topology
from ..errors import RouteStateError
from . import state
from .swap import Call, RefusedError, enter

if TYPE_CHECKING:
    from ..adapters import Routing

log = logging.getLogger("wrapperroute")


def fallback_key(fn: Callable[..., Any]) -> object:
    """What identifies a loss for the fallback: its code object (or its type, for a callable object)."""
    code = getattr(fn, "__code__", None)
    if code is not None:  # a plain function or lambda: the common case
        return code
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    return getattr(fn, "__code__", None) or type(fn)


def _is_graph_optimizer_failure(error: BaseException) -> bool:
    """The DDP graph optimizer split a graph inside a torch.func transform (see adapters/ddp.py)."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if "TensorWrapper" in str(current):
            return True
        pending += [current.__cause__, current.__context__, getattr(current, "inner_exception", None)]
    return False


def _isolation_to_retry(call: Call, error: BaseException) -> Isolating | None:
    """The adapter to isolate a call that failed so, run once more: a DDP graph-optimizer failure of an ``"auto"``
    call not isolated already; None where the wrapper has no such pass (FSDP, DeepSpeed: an isolated rerun would
    be the same call again)."""
    adapter = call.adapter
    isolated = call.around is not None and call.around.isolation is not None
    if (
        isinstance(error, Exception)
        and call.mode == "auto"
        and not isolated
        and isinstance(adapter, Isolating)
        and _is_graph_optimizer_failure(error)
    ):
        return adapter
    return None


def run(call: Call) -> Any:
    """Enter the wrapper with ``call``; if its loss fails under DDP's graph optimizer, once more isolated from it.
    Whatever raises leaves the wrapper in its between-steps state."""
    hooks_enabled = saved_tensor_hooks_enabled()
    try:
        return enter(call)
    except BaseException as error:  # KeyboardInterrupt too: a notebook user may go on training
        if _refused(error, call):
            raise
        recover(call.adapter, call.wrapper)
        # A compile that failed inside a torch.func transform leaves it half-run; entering it disabled
        # saved-tensor hooks, and everything after (the retry, gradient checkpointing) would fail without them.
        if hooks_enabled and not saved_tensor_hooks_enabled():
            enable_saved_tensor_hooks()
        isolation = _isolation_to_retry(call, error)
        if isolation is None:
            raise
    state.isolated_losses.add(fallback_key(call.fn))
    log.warning(
        "wrapperroute: %s failed under DDP's graph optimizer (a torch.func loss split across buckets); "
        "running it isolated from that optimizer from now on. Pass mode='isolate' to skip the first attempt.",
        getattr(call.fn, "__qualname__", type(call.fn).__name__),
    )
    call = call.isolated(isolation)
    try:
        return enter(call)
    except BaseException as error:
        if not _refused(error, call):
            recover(call.adapter, call.wrapper)
        raise


def _refused(error: BaseException, call: Call) -> bool:
    """Whether ``call`` itself was refused, entering nothing: the wrapper belongs to the thread inside it and is
    left alone. A nested unit refused after this call entered its wrapper is this call's fault to recover."""
    return isinstance(error, RefusedError) and error.call is call


def recover(adapter: Routing, wrapper: nn.Module) -> None:
    """The wrapper back to its between-steps state after a fault (the adapter's ``recover``), never masking the
    loss's own error."""
    try:
        adapter.recover(wrapper)
    except Exception:  # never mask the loss's own error; say loudly that the wrapper may be unusable
        log.exception("wrapperroute: could not reset the %s wrapper after a failed step", adapter.kind)


def agree(adapter: Routing, wrapper: nn.Module, error: BaseException | None) -> None:
    """Exchange one success flag with every rank of the wrapper's group; raise if any rank failed.

    On a side group (made by the wrapper group's members only, again after the process group is re-created), so
    a rank that failed before one of the wrapper's own collectives never pairs this all-reduce with it.
    """
    ranks = (adapter.step_ranks(wrapper) if isinstance(adapter, Topology) else None) or tuple(
        range(dist.get_world_size())
    )
    side = side_group(ranks)
    device = collective_device(side)
    flags = torch.zeros(len(ranks), dtype=torch.int32, device=device)
    flags[ranks.index(dist.get_rank())] = error is not None
    dist.all_reduce(flags, group=side)
    failed = [rank for rank, flag in zip(ranks, flags.tolist(), strict=True) if flag]
    if not failed:
        return
    if error is None:  # our step ran to the end: reset as the failed ranks did, so every rank's state matches
        recover(adapter, wrapper)
    here = dist.get_rank()
    what = f"{type(error).__name__}: {error}" if error is not None else "none here"
    raise RouteStateError(
        f"route_loss failed on rank(s) {failed} of {list(ranks)} (this is rank {here}; its error: {what}). Every "
        "rank stops here instead of waiting in the backward's collectives; the wrapper is reset and usable. "
        "See the failed ranks' tracebacks for the cause."
    ) from error
