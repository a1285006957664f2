"""Running a routed call, and the functorch fallback: a compiled ``torch.func`` loss that DDP's graph optimizer
cannot split is run once more isolated from that optimizer (``adapters/ddp.py``), and stays isolated for the
process. What happens to the wrapper after a loss that raised is ``_faults.py``'s."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from ._faults import _recover
from ._swap import _Call, _enter, _RefusedError
from ._torch_internals import enable_saved_tensor_hooks, saved_tensor_hooks_enabled

log = logging.getLogger("wrapperroute")

# Code objects (or callable types) of losses that failed under DDP's graph optimizer: routed isolated from
# then on, so the failure and the retry happen once per process, not once per step.
_isolated_losses: set[object] = set()


def _fallback_key(fn: Callable[..., Any]) -> object:
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


def _retried_isolated(call: _Call, error: BaseException) -> bool:
    """Whether a call that failed so is run once more isolated: a DDP graph-optimizer failure of an ``"auto"``
    call not isolated already (FSDP, DeepSpeed: an isolated rerun would be the same call again)."""
    isolated = call.around is not None and call.around.isolate
    return (
        isinstance(error, Exception)
        and call.mode == "auto"
        and not isolated
        and call.adapter.isolates
        and _is_graph_optimizer_failure(error)
    )


def _run(call: _Call) -> Any:
    """Enter the wrapper with ``call``; if its loss fails under DDP's graph optimizer, once more isolated from it.
    Whatever raises leaves the wrapper in its between-steps state."""
    hooks_enabled = saved_tensor_hooks_enabled()
    try:
        return _enter(call)
    except BaseException as error:  # KeyboardInterrupt too: a notebook user may go on training
        if _refused(error, call):
            raise
        _recover(call.adapter, call.wrapper)
        # A compile that failed inside a torch.func transform leaves it half-run; entering it disabled
        # saved-tensor hooks, and everything after (the retry, gradient checkpointing) would fail without them.
        if hooks_enabled and not saved_tensor_hooks_enabled():
            enable_saved_tensor_hooks()
        if not _retried_isolated(call, error):
            raise
    _isolated_losses.add(_fallback_key(call.fn))
    log.warning(
        "wrapperroute: %s failed under DDP's graph optimizer (a torch.func loss split across buckets); "
        "running it isolated from that optimizer from now on. Pass mode='isolate' to skip the first attempt.",
        getattr(call.fn, "__qualname__", type(call.fn).__name__),
    )
    call = call.isolated()
    try:
        return _enter(call)
    except BaseException as error:
        if not _refused(error, call):
            _recover(call.adapter, call.wrapper)
        raise


def _refused(error: BaseException, call: _Call) -> bool:
    """Whether ``call`` itself was refused, entering nothing: the wrapper belongs to the thread inside it and is
    left alone. A nested unit refused after this call entered its wrapper is this call's fault to recover."""
    return isinstance(error, _RefusedError) and error.call is call
