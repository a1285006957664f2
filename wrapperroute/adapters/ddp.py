"""DistributedDataParallel.

``DDP.forward`` arms the reducer: ``_pre_forward`` calls ``prepare_for_forward`` (only when
``require_backward_grad_sync``, which is how ``no_sync()`` works) and ``_post_forward`` calls
``prepare_for_backward`` on the output, walking it for unused parameters when ``find_unused_parameters``.
Routing through ``ddp.__call__`` gets all of that, and every hook on the wrapper, for free.

The functorch fallback (``isolate=True``): ``_run_ddp_forward`` sets ``DDP._active_ddp_module`` and Dynamo,
compiling anything while it is set, swaps in its DDP graph optimizer, which splits graphs at bucket
boundaries. A split inside a ``torch.func`` transform (Liger's chunked losses) fails with "Cannot access
storage of TensorWrapper". Clearing the marker while the loss runs keeps that pass away from the loss alone:
the reducer is armed exactly as before, and compiled code outside the loss keeps the optimizer.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _find_tensors

from .._groups import group_ranks
from ..errors import RouteValueError
from .routing import Isolating, Routing
from .topology import ArmsInForward, Averaging, Replica, Topology, replicated

log = logging.getLogger("wrapperroute")


class DDPAdapter(Routing, Topology, Isolating, ArmsInForward):
    kind = "ddp"

    def claims(self, module: nn.Module) -> bool:
        return isinstance(module, DistributedDataParallel)

    def peel(self, module: nn.Module) -> nn.Module:
        inner: nn.Module = module.module  # type: ignore[assignment]
        return inner

    def marks_forward(self, wrapper: nn.Module) -> bool:
        # One class attribute, set while any DDP forward runs anywhere: whose, this thread's stack says.
        return DistributedDataParallel._active_ddp_module is not None

    def in_forward(self, wrapper: nn.Module) -> bool:
        active = getattr(DistributedDataParallel, "_active_ddp_module", None)
        if active is None:  # the common case: no DDP forward running anywhere
            return False
        # The marker is one class attribute shared by every thread, and DDP's save/restore of it is not
        # thread-safe: forwards that overlap in two threads can leave it set after both ended. Trusting a stale
        # marker would call the loss plainly, outside the forward: a silent desync. This thread's stack decides.
        return _forward_frame(sys._getframe(1), wrapper)

    def repair(self, wrapper: nn.Module) -> None:
        active = DistributedDataParallel._active_ddp_module
        if active is not None:  # rare: set while no forward of this thread runs (see in_forward)
            _clear_if_stale(active)

    def describe(self, wrapper: nn.Module) -> dict[str, Any]:
        ddp: DistributedDataParallel = wrapper  # type: ignore[assignment]
        return {
            "find_unused_parameters": ddp.find_unused_parameters,
            "static_graph": ddp.static_graph,
            "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
        }

    def isolated(self, wrapper: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return without_graph_optimizer()

    def result_check(self, wrapper: nn.Module) -> Callable[[nn.Module, Any], None] | None:
        ddp: DistributedDataParallel = wrapper  # type: ignore[assignment]
        return _check_reachable if ddp.find_unused_parameters else None  # fixed at construction

    def concurrency_error(self, wrapper: nn.Module, grad: bool, grad_calls: int) -> str | None:
        ddp: DistributedDataParallel = wrapper  # type: ignore[assignment]
        return concurrency_reason(ddp, grad, grad_calls)

    def step_ranks(self, wrapper: nn.Module) -> tuple[int, ...] | None:
        return group_ranks(wrapper.process_group)

    def syncs_gradients(self, wrapper: nn.Module) -> bool:
        return bool(getattr(wrapper, "require_backward_grad_sync", True))  # False inside no_sync()

    def replicas(self, wrapper: nn.Module) -> list[Replica]:
        return replicated(self.peel(wrapper), group_ranks(wrapper.process_group))

    def averaging(self, wrapper: nn.Module) -> Averaging:
        ddp: DistributedDataParallel = wrapper  # type: ignore[assignment]
        return mean_over(ddp, ddp.process_group)


def mean_over(ddp: DistributedDataParallel, group: Any) -> Averaging:
    """DDP's reducer sums each bucket over ``group`` and divides it by the group's size; so do torch's own
    communication hooks (``torch.distributed.algorithms.ddp_comm_hooks``: they divide by the group's size
    before or after their all-reduce). A hook of the user's own is not read: said in ``unread``."""
    ranks = group_ranks(group)
    foreign = [hook for hook, _state in getattr(ddp, "_comm_hooks", ())
               if not getattr(hook, "__module__", "").startswith("torch.")]  # fmt: skip
    unread = ""
    if foreign:
        name = getattr(foreign[0], "__qualname__", repr(foreign[0]))
        unread = (f"DDP communication hook {name} (not one of torch's) may scale the gradients as it likes; "
                  f"taken to average over the {len(ranks)} ranks of its group, as torch's hooks do")  # fmt: skip
    return Averaging(ranks, group, float(len(ranks)), unread=unread)


def _check_reachable(wrapper: nn.Module, result: Any) -> None:
    ddp: DistributedDataParallel = wrapper  # type: ignore[assignment]
    check_loss_reachable(ddp, result)


def check_loss_reachable(ddp: DistributedDataParallel, result: Any) -> None:
    """Reject, before DDP's post-forward sees it, a loss it cannot reach under ``find_unused_parameters``."""
    # With find_unused_parameters, _post_forward walks the output (_find_tensors: tensors, lists, tuples,
    # dicts, dataclasses) and marks every parameter it cannot reach as unused. A loss it cannot see (no
    # tensor, detached, or held in another object) gets every parameter marked unused, and the backward
    # then fails with DDP's misleading "marked as ready twice". Raised here, before _post_forward, the
    # reducer is left unprepared: the next step runs normally.
    if not (ddp.require_backward_grad_sync and torch.is_grad_enabled()):
        return
    if any(t.requires_grad for t in _find_tensors(result)):
        return
    raise RouteValueError(
        f"fn returned {type(result).__name__} with no tensor that requires grad, under DDP "
        "find_unused_parameters=True: DDP would mark every parameter unused and the backward would fail "
        "('marked as ready twice'). Return the loss tensor (alone or in a tuple, list, dict or dataclass); "
        "for a call that computes no loss (metrics, evaluation) run route_loss under torch.no_grad()."
    )


def concurrency_reason(ddp: DistributedDataParallel, grad: bool, grad_calls: int) -> str | None:
    """Why a DDP forward may not overlap another thread's, or None when it may."""
    # Gradient sync state (the reducer) is per model: one recorded forward per backward. A no-grad forward
    # leaves the reducer alone, unless it broadcasts buffers (a collective racing the other thread's).
    if ddp.will_sync_module_buffers():
        return "this DDP broadcasts module buffers in every forward, and two threads' broadcasts would race"
    if grad and grad_calls:
        return "DDP's reducer arms one forward per backward, so two grad-enabled forwards would corrupt it"
    return None


_RUN_FORWARD = DistributedDataParallel._run_ddp_forward.__name__
_stale_warned = False


def _forward_frame(frame: types.FrameType | None, wrapper: nn.Module | None) -> bool:
    """Whether ``frame`` or a caller is ``wrapper``'s ``_run_ddp_forward`` (any DDP's, when None). Matched by
    name and ``self``, not by code object: a DDP subclass may override it (and need not call DDP's own)."""
    while frame is not None:
        if frame.f_code.co_name == _RUN_FORWARD:
            owner = frame.f_locals.get("self")
            if owner is wrapper if wrapper is not None else isinstance(owner, DistributedDataParallel):
                return True
        frame = frame.f_back
    return False


def _clear_if_stale(active: nn.Module) -> None:
    """Clear a marker no thread's DDP forward set: while it stays, Dynamo applies DDP's graph optimizer to
    everything compiled anywhere in the process (a torch.func loss compiled later fails on it)."""
    global _stale_warned
    if any(_forward_frame(frame, None) for frame in sys._current_frames().values()):
        return  # some thread is inside a DDP forward: the marker may be its own
    if DistributedDataParallel._active_ddp_module is active:
        DistributedDataParallel._active_ddp_module = None
        if not _stale_warned:
            _stale_warned = True
            log.warning(
                "wrapperroute: DistributedDataParallel._active_ddp_module was left set after every DDP forward "
                "ended (DDP forwards that overlapped in two threads; DDP saves and restores it per thread); "
                "cleared, so Dynamo stops applying DDP's graph optimizer outside DDP forwards."
            )


@contextlib.contextmanager
def without_graph_optimizer() -> Iterator[None]:
    # Same save/restore discipline as DDP's own ``_inside_ddp_forward`` (nested DDP).
    previous = DistributedDataParallel._active_ddp_module
    DistributedDataParallel._active_ddp_module = None
    try:
        yield
    finally:
        DistributedDataParallel._active_ddp_module = previous
