"""``route_loss``: run a loss inside the distributed wrapper's forward.

In DDP's shape: *plan* (``_routing/plan.py``: the arguments checked, the wrapper found, or None: call ``fn``
plainly), *run* (``_routing/run.py``: enter the wrapper, whose forward runs the loss through the forward swap of
``_routing/swap.py``: for the length of one call, the module the wrapper's forward calls gets an instance
``forward`` that runs the loss, and the wrapper is called with the call as its one argument, so it does
everything it does in a real forward around the loss: arms DDP's reducer, unshards FSDP units, gathers ZeRO-3
parameters; after a fault, the wrapper back to its between-steps state and, where DDP's graph optimizer failed,
the loss once more isolated from it); ``agree`` exchanges one flag after it (``run.py`` too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
from torch import nn

from ._routing.plan import MODES, Mode, resolve
from ._routing.run import agree as _agree
from ._routing.run import run as _run
from ._torch_internals import dynamo_disabled_lazily

T = TypeVar("T")

__all__ = ["MODES", "Mode", "route_loss"]


def route_loss(
    model: nn.Module,
    unwrapped: nn.Module | None,
    fn: Callable[..., T],
    *args: Any,
    mode: Mode = "auto",
    gather: nn.Module | Iterable[nn.Module] | None = None,
    agree: bool = False,
    **kwargs: Any,
) -> T:
    """Call ``fn(*args, **kwargs)`` inside ``model``'s distributed-wrapper forward and return its result.

    Gradients of a loss returned this way are what the wrapper would produce for a normal ``model(...)``
    forward: all-reduced by DDP, reduce-scattered by FSDP, partitioned by ZeRO-3. With no distributed wrapper
    (one process, a plain module) ``fn`` is simply called.

    Args:
        model: what the trainer holds: a DDP/FSDP/DeepSpeed wrapper, possibly under ``torch.compile``.
        unwrapped: the inner module ``fn`` reads (``model.module``, ``accelerator.unwrap_model(model)``), or
            ``None`` to skip the containment check. It is validated, not used: ``fn`` closes over it.
        fn: the loss. Its arguments travel by reference, never through the wrapper, so they are neither
            moved, cast nor scattered. It may return any pytree (tensor, tuple, dict, ``ModelOutput``).
        mode: ``"auto"`` (default) runs ``fn`` in the forward; if DDP's graph optimizer fails on a
            ``torch.func`` loss ("Cannot access storage of TensorWrapper"), ``fn`` is run once more isolated
            from that optimizer, and that loss stays isolated for the rest of the process. ``"isolate"``
            isolates from the first call (use it when ``fn`` has side effects before its first compiled
            call). ``"redirect"`` never isolates.
        gather: modules whose parameters ``fn`` reads directly and that live in their own shard unit (FSDP)
            or partition (ZeRO-3), e.g. ``[unwrapped.lm_head]``; ignored by replicated wrappers.
        agree: after ``fn`` (raised or not), every rank of the wrapper's process group exchanges one success
            flag (one small all-reduce on a side group, so it never pairs with the wrapper's own collectives).
            If ``fn`` failed on any rank, every rank raises :class:`RouteStateError` naming the failed ranks
            (chained to the error on the ranks where it happened) instead of the others hanging in the
            backward's collectives. Off by default: it costs one collective per step. Without it, a failure on
            one rank is bounded only by the process group's timeout (``init_process_group(timeout=...)``).

    If ``fn`` raises, the wrapper is returned to its between-steps state (forward restored, FSDP units resharded
    and idle, ZeRO-3 parameters released) and the error propagates: the next step is exact. So is a step after a
    plain forward that raised. Routed as usual: ``torch.no_grad()`` (evaluation), ``eval()`` mode, a call from
    inside the wrapper's own forward (``fn`` is then called directly). Two threads may route through one DDP
    model at once when at most one records a graph; other concurrent use raises :class:`RouteStateError`.
    Keyword arguments named ``mode``, ``gather`` or ``agree`` are ``route_loss``'s: pass such arguments to
    ``fn`` with ``functools.partial``.
    """
    if torch.compiler.is_compiling():  # Dynamo traces a compiled forward that routes: run this eagerly, between
        return _eager(model, unwrapped, fn, *args, mode=mode, gather=gather, agree=agree, **kwargs)  # its graphs
    call = resolve(model, unwrapped, fn, args, kwargs, mode, gather)  # checks the arguments, finds the wrapper
    if call is None:  # no wrapper to route through, or already inside its forward
        return fn(*args, **kwargs)
    if not agree:
        return _run(call)
    try:  # the same call, then one flag exchanged, raised or not
        result: T = _run(call)
    except BaseException as error:
        _agree(call.adapter, call.wrapper, error)
        raise
    _agree(call.adapter, call.wrapper, None)
    return result


# route_loss swaps forwards and reads this thread's stack: eager work, never traced. (Dynamo imported on the first
# call under it, not with this module: over half a second in every process that imports wrapperroute.)
_eager = dynamo_disabled_lazily(route_loss)
