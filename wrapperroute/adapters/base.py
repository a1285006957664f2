"""The two protocols of the wrapper families.

A *layer* is anything that can sit between the object a trainer holds and the module that owns the
parameters: ``torch.compile``'s ``OptimizedModule``, DDP, FSDP1, FSDP2, a DeepSpeed engine, a PEFT model, a
Lightning Fabric module. A :class:`Layer` is only peeled, so :func:`wrapperroute.detect` can see through it
(compile, PEFT). An :class:`Adapter` is also routed through: a *distributed* wrapper, or a layer that is
*entered* (Fabric's module, whose forward runs around the wrapper's, or alone on one device). What each
declares and overrides (a blank is the default below):

=================  ===========================================  =============================================
adapter (kind)     class facts                                  overrides
=================  ===========================================  =============================================
compile, peft      a Layer: peeled only                         claims, peel
fabric             enters, not distributed                      claims, peel
ddp                distributed, arms_in_forward, isolates       marks_forward, in_forward, repair, describe,
                                                                around_loss (isolate), result_check
                                                                (find_unused), concurrency_error, step_ranks,
                                                                syncs_gradients, replicas, averaging
replicate          distributed, arms_in_forward, isolates       as ddp but in_forward and repair (the base
                                                                class's), with recover, around_loss (hooks
                                                                set aside), inner_wrappers and meshes
fsdp1              distributed, shards, picks_units             redirect_target, marks_forward, describe,
                                                                recover, nested_units, step_ranks, read_whole
                                                                (warns), replicas (NO_SHARD), averaging
fsdp2              distributed, shards, picks_units             marks_forward, describe, recover, nested_units,
                                                                around_loss (hooks set aside), step_ranks,
                                                                read_whole, replicas, averaging, meshes
replicate_fsdp     as fsdp2, not shards                         claims
deepspeed          distributed, shards, picks_units             marks_forward, describe, validate_gather,
                                                                recover, prepare (the head registered),
                                                                around_loss, concurrency_error, step_ranks,
                                                                read_whole, replicas (ZeRO 0-2, experts),
                                                                averaging
=================  ===========================================  =============================================

The class facts are read once per model and decide ``route_loss``'s fast path; the methods are asked per call
only where a fact says they matter.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from ._hooks import called_here

NOTHING = contextlib.nullcontext()  # reusable and re-entrant: the default ``around_loss``


@dataclass(frozen=True)
class Replica:
    """A trainable parameter and the ranks holding a copy of it: what :meth:`Adapter.replicas` returns, and what
    every cross-rank comparison (``check_grad_sync``, the audit, ``wrapperroute check``) compares.

    name
        The parameter's name under the wrapper's inner module (the audit puts the wrapper's in front).
    param
        The parameter (a ``DTensor``'s local part is what is compared).
    copies
        The global ranks whose copy must equal this rank's, this rank included: the same tuple on each of them.
        This rank alone: no copy to compare with (``alone`` says why).
    grads
        Whether its gradient is replicated too (not for DeepSpeed ZeRO 1-2, whose gradients are partitioned).
    alone
        Why no other rank holds a copy, when none does: ``"sharded"`` (each rank holds its part), ``"expert
        group of one"``...; empty when copies exist.
    """

    name: str
    param: torch.Tensor
    copies: tuple[int, ...]
    grads: bool = True
    alone: str = ""

    @property
    def compared(self) -> bool:
        """Whether another rank holds a copy to compare with."""
        return len(self.copies) > 1


@dataclass(frozen=True)
class Averaging:
    """How a wrapper makes one gradient of the ranks' gradients: what :meth:`Adapter.averaging` returns, and what
    :func:`wrapperroute.token_divisor` divides by.

    ranks
        The global ranks whose gradients are reduced together (this rank included; the same tuple on each of
        them): the ranks that train on different data. Tensor-parallel ranks, which read the same batch, are
        not among them.
    group
        A process group over exactly ``ranks`` that the wrapper already has, or None when it has none (HSDP's
        two dimensions): one is then made for them.
    divides_by
        What the wrapper divides the summed gradient by: the number of ranks for a mean, a divide factor the
        user set (FSDP2's ``set_gradient_divide_factor``), 1 for a sum.
    backward_divides_by
        What the wrapper's own backward divides each micro-batch's loss by before the gradients exist:
        DeepSpeed's ``gradient_accumulation_steps`` (``engine.backward(loss)``, or its hooks on
        ``loss.backward()``); 1 elsewhere.
    unread
        What of the reduction the wrapper's state does not tell (a communication hook of the user's own, which may
        scale as it likes), said aloud by ``token_divisor``; empty when everything was read.
    """

    ranks: tuple[int, ...]
    group: Any
    divides_by: float
    backward_divides_by: float = 1.0
    unread: str = ""


@dataclass(frozen=True)
class Assigned:
    """Sharded parameters whose gradients a wrapper assigns itself, after its own reduction, with no gradient ever
    computed for them by autograd (FSDP2): what :meth:`Adapter.assigned_gradients` returns, and what
    :mod:`wrapperroute.arrivals` watches. A gradient autograd computes for one of them arrived around the reduction.

    reduction
        The reduction's name, as a report says it (``"FSDP2's reduce-scatter"``).
    params
        ``(name, sharded parameter)``: the name under the wrapper's inner module, the parameter the optimizer steps.
    """

    reduction: str
    params: list[tuple[str, torch.Tensor]]


class Layer:
    """A layer that is only peeled (``torch.compile``, PEFT): never routed through.

    kind
        Short stable name reported by :func:`wrapperroute.detect` (``"compile"``, ``"peft"``...).
    """

    kind: ClassVar[str] = "?"
    distributed: ClassVar[bool] = False
    enters: ClassVar[bool] = False

    def claims(self, module: nn.Module) -> bool:
        """Whether ``module`` is a layer of this family."""
        raise NotImplementedError

    def peel(self, module: nn.Module) -> nn.Module:
        """The next module inward. A layer that *is* the model (FSDP2) returns ``module`` itself."""
        raise NotImplementedError


class Adapter(Layer):
    """Knows one wrapper family that is routed through. Subclasses override what differs; the defaults fit a
    wrapper that holds every parameter whole and keeps no forward state.

    distributed
        True when the layer's forward arms gradient synchronisation or gathers parameters, i.e. when a loss
        must run *inside* its forward.
    shards
        True when each rank holds a different part of the parameters and gradients by design (FSDP, ZeRO).
    arms_in_forward
        True when gradient synchronisation is armed by the wrapper's forward and a backward without it stays
        local, silently (DDP's reducer, composable ``replicate``): what :func:`wrapperroute.guard` watches.
        Sharded wrappers fail loudly instead.
    isolates
        True when ``around_loss(..., isolate=True)`` changes anything: the wrapper's forward sets DDP's forward
        marker, under which Dynamo applies DDP's graph optimizer (DDP, composable ``replicate``). Only then
        does the functorch fallback retry a loss.
    picks_units
        True when ``validate_gather`` and ``nested_units`` do something (sharded wrappers): asked on every
        call; False lets ``route_loss`` skip both.
    enters
        True for a layer that is not distributed itself but whose own forward must run around the wrapper's
        (Lightning Fabric's precision context): :func:`wrapperroute.route_loss` calls that layer, not the
        wrapper inside it.
    """

    distributed: ClassVar[bool] = True
    shards: ClassVar[bool] = False
    arms_in_forward: ClassVar[bool] = False
    isolates: ClassVar[bool] = False
    picks_units: ClassVar[bool] = False

    def redirect_target(self, wrapper: nn.Module) -> nn.Module:
        """The module whose ``forward`` the wrapper's forward calls: its forward is swapped for the loss."""
        return self.peel(wrapper)

    def marks_forward(self, wrapper: nn.Module) -> bool:
        """Whether the wrapper's own state says a forward is running (FSDP's training state, ZeRO-3's flag). Cheap
        and process-wide, so not proof: another thread's forward sets it too, and a forward that raised leaves it
        set until the wrapper's next forward repairs it."""
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
        forward: put right state that a forward
        which raised outside our calls left behind (the bad batch a loop skips): the wrapper marks a forward
        that no thread is running. Left so, FSDP's next forward reuses the parameters that forward gathered,
        however the optimizer changed them since, and FSDP1 refuses ``no_sync``; so the wrapper is returned to
        its between-steps state, as ``recover`` does after a loss of ours raised (FSDP2's documented recovery,
        ``reset_iter_state``). No collective; no-op while another thread runs its forward."""
        if self.marks_forward(wrapper) and not any(
            called_here(wrapper, frame) for frame in sys._current_frames().values()
        ):
            self.recover(wrapper)

    def describe(self, wrapper: nn.Module) -> dict[str, Any]:
        """Extra facts for :class:`~wrapperroute.Detection` (e.g. the ZeRO stage)."""
        return {}

    def around_loss(
        self, wrapper: nn.Module, *, isolate: bool, gather: tuple[nn.Module, ...]
    ) -> contextlib.AbstractContextManager[Any]:
        """Context entered inside the wrapper's forward, around the loss (on every step: keep it cheap).

        ``isolate``: keep wrapper-specific compiler passes away from the loss (the functorch fallback).
        ``gather``: modules whose parameters the loss reads directly and that must be whole while it runs.
        Asked once per model with ``isolate=False, gather=()`` (the context is made, not entered): an adapter that
        returns ``NOTHING`` there is not asked on such calls again, so that answer must depend on nothing but
        the arguments.
        """
        return NOTHING

    def nested_units(self, wrapper: nn.Module, gather: tuple[nn.Module, ...]) -> tuple[nn.Module, ...]:
        """Shard units below the wrapper whose forward must also run for the loss (outermost first).

        ``gather`` names the modules the loss reads; when empty, a sharded wrapper may pick them itself.
        """
        return ()

    def result_check(self, wrapper: nn.Module) -> Callable[[nn.Module, Any], None] | None:
        """A check ``(wrapper, result)`` that rejects, inside the forward (so the wrapper's post-forward never
        sees it), a loss result the wrapper would mishandle; None when this wrapper needs none. Asked once per
        model; the check runs on every routed step, so keep it cheap, and module-level (a plan must not hold
        the wrapper)."""
        return None

    def recover(self, wrapper: nn.Module) -> None:
        """Return the wrapper to its between-steps state after an exception escaped its forward (raised by the
        loss, or by the wrapper around it). Must not run collectives: on a fault, ranks may have diverged."""

    def concurrency_error(self, wrapper: nn.Module, grad: bool, grad_calls: int) -> str | None:
        """Why a routed forward may not start while another thread is inside this wrapper's forward (``grad``:
        this call records a graph; ``grad_calls``: in-flight calls that do), or None when it may."""
        return f"{self.kind} is not thread-safe: concurrent forwards unshard and reshard each other's parameters"

    def step_ranks(self, wrapper: nn.Module) -> tuple[int, ...] | None:
        """The global ranks that all run this wrapper's step (``agree=True`` exchanges its flag among them);
        None: every rank of the default group."""
        return None

    def replicas(self, wrapper: nn.Module) -> list[Replica]:
        """Every trainable parameter of the wrapper's model, each with the ranks holding a copy equal to this
        rank's (what a desync makes differ), or this rank alone and why (sharded). Read from what each rank
        trains: a parameter the wrapper leaves whole on every rank of its mesh must be equal there, whether the
        wrapper synchronises it or not (an adapter added after ``fully_shard``). The default: every parameter
        sharded."""
        rank = dist.get_rank()
        return [Replica(name, param, (rank,), alone="sharded")
                for name, param in self.peel(wrapper).named_parameters() if param.requires_grad]  # fmt: skip

    def assigned_gradients(self, wrapper: nn.Module) -> Assigned | None:
        """The sharded parameters whose gradients this wrapper assigns itself after reducing them, where autograd
        never computes one (a gradient it does compute came around the reduction: see
        :mod:`wrapperroute.arrivals`); None where gradients reach the wrapper's reduction through autograd on every
        route (DDP's and ZeRO's hooks on each parameter's accumulation, FSDP1's on its flat parameter) or a read
        outside its forward fails loudly (a 0-element ZeRO-3 partition, FSDP1's 1-D shard)."""
        return None

    def averaging(self, wrapper: nn.Module) -> Averaging | None:
        """Which ranks' gradients this wrapper reduces together, and what it divides them by (read from the
        wrapper's own state and the installed code); None when it cannot be told."""
        return None

    def step_count(self, wrapper: nn.Module, optimizer: Any) -> int | None:
        """The wrapper's own count of optimizer steps taken, where it steps the torch ``optimizer`` itself, in
        parts (DeepSpeed's ZeRO optimizer steps its inner one once per parameter group: MoE's dense and expert
        groups, the model half updated in between); None where it does not step that optimizer, or where each of
        its steps is a training step."""
        return None

    def syncs_gradients(self, wrapper: nn.Module) -> bool:
        """Whether the next backward is meant to reduce gradients across ranks (False under ``no_sync()`` or
        ``set_requires_gradient_sync(False)``). Default: always."""
        return True

    def inner_wrappers(self, wrapper: nn.Module) -> tuple[nn.Module, ...]:
        """Wrapper objects this one keeps of its own over the same parameters (composable ``replicate``'s
        ``DistributedDataParallel``): not wrappers of their own to a scan of the process. Default: none."""
        return ()

    def meshes(self, wrapper: nn.Module) -> tuple[Any, ...]:
        """The device meshes this wrapper itself shards or replicates parameters over (FSDP2's, ``replicate``'s),
        so that a tensor-parallel layout on the same parameters is told apart from it. Default: none."""
        return ()

    def read_whole(self, wrapper: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """Context entered *outside* the wrapper's forward in which a frozen model's weights that a loss reads
        directly (the root's own parameters, the output embedding) are whole: a reference or teacher model that
        the loss reads under no gradient. Nothing is reduced. The default: a replicated wrapper holds them
        whole already."""
        return NOTHING

    def validate_gather(self, wrapper: nn.Module, gather: tuple[nn.Module, ...]) -> None:
        """Reject ``gather=`` entries this wrapper cannot honour.

        The default accepts any: a replicated wrapper (DDP) holds every parameter whole already, so code that
        passes the same ``gather=`` under every wrapper keeps working.
        """
