"""One small window on the routing state, for the tests and ``wrapperroute check``: what is planned, swapped,
in flight and isolated right now. Never on the hot path; nothing here changes routing except
:func:`forget_isolated`, which a check uses to compile a loss afresh."""

from __future__ import annotations

from dataclasses import dataclass

from ._fallback import _isolated_losses
from ._plan import _plans
from ._swap import _swaps, _thread


@dataclass(frozen=True)
class RoutingState:
    plans: int  # models with a plan
    swaps: int  # modules with a swap record (kept while the module lives)
    in_flight: int  # routed calls running now, every thread
    grad_in_flight: int  # of those, the calls recording a graph
    locks_held: int  # swap locks held right now
    passthroughs: int  # wrappers whose forward is our passthrough right now
    routing_here: int  # wrappers this thread is running a loss inside
    isolated: frozenset[object]  # losses routed isolated from DDP's graph optimizer


def routing_state() -> RoutingState:
    swaps = list(_swaps.values())
    return RoutingState(
        plans=len(_plans),
        swaps=len(swaps),
        in_flight=sum(s.count for s in swaps),
        grad_in_flight=sum(s.grad_calls for s in swaps),
        locks_held=sum(s.lock.locked() for s in swaps),
        passthroughs=sum(s.wrapper is not None for s in swaps),
        routing_here=len(_thread.routing),
        isolated=frozenset(_isolated_losses),
    )


def forget_isolated(keys: frozenset[object] | None = None) -> None:
    """Route these losses (all, when None) with DDP's graph optimizer again, as on a first call."""
    if keys is None:
        _isolated_losses.clear()
    else:
        _isolated_losses.difference_update(keys)
