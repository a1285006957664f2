"""The routing state: every process-wide registry of the routing core, and the one window onto it.

- ``plans``: what ``plan.py`` learnt about each model object (by ``id``, dropped with the model);
- ``swaps``: each target module's swap record (``swap.py``), kept while the module lives;
- ``isolated_losses``: the losses the functorch fallback runs isolated from DDP's graph optimizer (``run.py``);
- ``thread``: per thread, the wrappers whose forward is running a loss of this thread.

:func:`routing_state` reads them for the tests and ``wrapperroute check``; nothing here changes routing except
:func:`forget_isolated`, which a check uses to compile a loss afresh. Never on the hot path.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

plans: dict[int, Any] = {}  # id(model) -> plan.Plan
swaps: dict[int, Any] = {}  # id(target) -> swap.Swap
swaps_lock = threading.Lock()  # held while a swap record is made
# Code objects (or callable types) of losses that failed under DDP's graph optimizer: routed isolated from then on,
# so the failure and the retry happen once per process, not once per step.
isolated_losses: set[object] = set()


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.routing: set[int] = set()  # ids of wrappers whose forward is running a loss in this thread


thread = _ThreadState()


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
    records = list(swaps.values())
    return RoutingState(
        plans=len(plans),
        swaps=len(records),
        in_flight=sum(s.count for s in records),
        grad_in_flight=sum(s.grad_calls for s in records),
        locks_held=sum(s.lock.locked() for s in records),
        passthroughs=sum(s.wrapper is not None for s in records),
        routing_here=len(thread.routing),
        isolated=frozenset(isolated_losses),
    )


def forget_isolated(keys: frozenset[object] | None = None) -> None:
    """Route these losses (all, when None) with DDP's graph optimizer again, as on a first call."""
    if keys is None:
        isolated_losses.clear()
    else:
        isolated_losses.difference_update(keys)
