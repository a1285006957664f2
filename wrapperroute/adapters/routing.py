"""The routing protocol: what ``route_loss`` (``wrapperroute/_routing/``) asks of a layer it enters, and the
capabilities a few wrappers add to it.

An adapter with :class:`Routing` is entered: ``route_loss`` swaps the forward of its ``redirect_target`` for the
loss and calls the layer. A distributed wrapper has it (DDP, FSDP, DeepSpeed: the loss must run inside their
forward), and so does a layer whose own forward must run around the wrapper's (Lightning Fabric's precision
context). The defaults fit a layer that holds every parameter whole and keeps no forward state.

Capabilities, each with the verbs only its wrappers need; ``route_loss`` reads once per model which ones an
adapter has, so a wrapper without them pays nothing for them per call:

- :class:`AroundLoss`: a context entered around every loss inside the forward (the wrapper's own hooks set
  aside: FSDP2, composable ``replicate``, DeepSpeed, which also gathers ``gather=`` under ZeRO-3);
- :class:`Isolating`: a context that keeps the wrapper's compiler pass away from the loss (DDP's graph
  optimizer: the functorch fallback retries a loss isolated only where the adapter has it);
- :class:`ShardUnits`: nested shard units whose forward the loss must also run through (FSDP1, FSDP2).
"""

from __future__ import annotations

import contextlib
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from torch import nn

from ._hooks import called_here
from .layer import Layer

NOTHING = contextlib.nullcontext()  # reusable and re-entrant: nothing to enter


class Routing(Layer):
    """A layer ``route_loss`` enters. Every verb has a default; a wrapper overrides what differs."""

    def redirect_target(self, wrapper: nn.Module) -> nn.Module:
        """The module whose ``forward`` the wrapper's forward calls: its forward is swapped for the loss."""
        return self.peel(wrapper)

    def marks_forward(self, wrapper: nn.Module) -> bool:
        """Whether the wrapper's own state says a forward is running (FSDP's training state, ZeRO-3's flag). Cheap
        and process-wide, so not proof: another thread's forward sets it too, and a forward that raised leaves it
        set until the wrapper's next forward repairs it. Asked on every call that finds no call of ours in flight:
        keep it to a few attribute reads."""
        return False

    def in_forward(self, wrapper: nn.Module) -> bool:
        """Whether this thread is inside the wrapper's own forward right now (routing again would re-enter it):
        the wrapper's mark, confirmed by this thread's stack. A query: it changes nothing."""
        return self.marks_forward(wrapper) and called_here(wrapper, sys._getframe(1))

    def prepare(self, wrapper: nn.Module) -> None:
        """Once per model, before its first routed call enters the wrapper: set up what every routed call relies
        on (ZeRO-3: the head registered with the root). The default: nothing."""

    def repair(self, wrapper: nn.Module) -> None:
        """Before a routed call enters a wrapper that ``marks_forward`` while this thread is not inside its
        forward: put right state that a forward which raised outside our calls left behind (the bad batch a loop
        skips). Left so, FSDP's next forward reuses the parameters that forward gathered, however the optimizer
        changed them since, and FSDP1 refuses ``no_sync``; so the wrapper is returned to its between-steps state,
        as ``recover`` does after a loss of ours raised. No collective; no-op while another thread runs its
        forward."""
        if self.marks_forward(wrapper) and not any(
            called_here(wrapper, frame) for frame in sys._current_frames().values()
        ):
            self.recover(wrapper)

    def recover(self, wrapper: nn.Module) -> None:
        """Return the wrapper to its between-steps state after an exception escaped its forward (raised by the
        loss, or by the wrapper around it). Must not run collectives: on a fault, ranks may have diverged."""

    def result_check(self, wrapper: nn.Module) -> Callable[[nn.Module, Any], None] | None:
        """A check ``(wrapper, result)`` that rejects, inside the forward (so the wrapper's post-forward never
        sees it), a loss result the wrapper would mishandle; None when this wrapper needs none. Asked once per
        model; the check runs on every routed step, so keep it cheap, and module-level (a plan must not hold
        the wrapper)."""
        return None

    def validate_gather(self, wrapper: nn.Module, gather: tuple[nn.Module, ...]) -> None:
        """Reject ``gather=`` entries this wrapper cannot honour (asked only when some are given; ``route_loss``
        has checked they are inside the model). The default accepts any: a replicated wrapper (DDP) holds every
        parameter whole already, so code that passes the same ``gather=`` under every wrapper keeps working."""

    def concurrency_error(self, wrapper: nn.Module, grad: bool, grad_calls: int) -> str | None:
        """Why a routed forward may not start while another thread is inside this wrapper's forward (``grad``:
        this call records a graph; ``grad_calls``: in-flight calls that do), or None when it may."""
        return f"{self.kind} is not thread-safe: concurrent forwards unshard and reshard each other's parameters"


class AroundLoss(ABC):
    """A wrapper with something to enter around every loss, inside its forward."""

    @abstractmethod
    def around_loss(self, wrapper: nn.Module, gather: tuple[nn.Module, ...]) -> contextlib.AbstractContextManager[Any]:
        """Context entered inside the wrapper's forward, around the loss, on every step (keep it cheap).
        ``gather``: modules whose parameters the loss reads directly and that must be whole while it runs."""


class Isolating(ABC):
    """A wrapper whose forward switches on a compiler pass that a compiled ``torch.func`` loss cannot go through
    (DDP's forward marker, under which Dynamo applies DDP's graph optimizer): only for such a wrapper does the
    functorch fallback run a failed loss again, isolated."""

    @abstractmethod
    def isolated(self, wrapper: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Context entered around the loss, inside the forward, that keeps the pass away from the loss alone."""


class ShardUnits(ABC):
    """A sharded wrapper whose nested units unshard only in their own forward: a loss reading their weights
    directly is routed through them too."""

    @abstractmethod
    def nested_units(self, wrapper: nn.Module, gather: tuple[nn.Module, ...]) -> tuple[nn.Module, ...]:
        """Shard units below the wrapper whose forward must also run for the loss (outermost first). ``gather``
        names the modules the loss reads; when empty, the wrapper picks them itself (the output embedding's)."""
