"""The topology protocol: which ranks hold a copy of each parameter, how the wrapper reduces and averages
gradients, how it counts steps. What :func:`~wrapperroute.check_grad_sync`, :func:`~wrapperroute.guard`,
:func:`~wrapperroute.token_divisor`, the audit and ``agree=True`` ask of a distributed wrapper; an adapter with it
is one (:func:`wrapperroute.detect` reports it as the wrapper).

Every answer is read from the wrapper's own state and the installed code, never from a list of names. One
capability goes with it: :class:`ArmsInForward`, a wrapper whose gradient synchronisation is armed by its forward
(what :func:`~wrapperroute.guard` watches).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .layer import Layer


@dataclass(frozen=True)
class Replica:
    """A trainable parameter and the ranks holding a copy of it: what :meth:`Topology.replicas` returns, and what
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
    """How a wrapper makes one gradient of the ranks' gradients: what :meth:`Topology.averaging` returns, and what
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
    computed for them by autograd (FSDP2): what :meth:`Topology.assigned_gradients` returns, and what
    :mod:`wrapperroute.arrivals` watches. A gradient autograd computes for one of them arrived around the reduction.

    reduction
        The reduction's name, as a report says it (``"FSDP2's reduce-scatter"``).
    params
        ``(name, sharded parameter)``: the name under the wrapper's inner module, the parameter the optimizer steps.
    """

    reduction: str
    params: list[tuple[str, torch.Tensor]]


class Topology(Layer):
    """A distributed wrapper: the ranks that hold copies of its parameters and how it averages their gradients.
    ``replicas`` and ``averaging`` are its to say; the rest have defaults."""

    def describe(self, wrapper: nn.Module) -> dict[str, Any]:
        """Extra facts for :class:`~wrapperroute.Detection` (e.g. the ZeRO stage)."""
        return {}

    @abstractmethod
    def replicas(self, wrapper: nn.Module) -> list[Replica]:
        """Every trainable parameter of the wrapper's model, each with the ranks holding a copy equal to this
        rank's (what a desync makes differ), or this rank alone and why (:func:`sharded`). Read from what each
        rank trains: a parameter the wrapper leaves whole on every rank of its mesh must be equal there, whether
        the wrapper synchronises it or not (an adapter added after ``fully_shard``)."""

    @abstractmethod
    def averaging(self, wrapper: nn.Module) -> Averaging | None:
        """Which ranks' gradients this wrapper reduces together, and what it divides them by (read from the
        wrapper's own state and the installed code); None when it cannot be told."""

    def step_ranks(self, wrapper: nn.Module) -> tuple[int, ...] | None:
        """The global ranks that all run this wrapper's step (``agree=True`` exchanges its flag among them);
        None: every rank of the default group."""
        return None

    def assigned_gradients(self, wrapper: nn.Module) -> Assigned | None:
        """The sharded parameters whose gradients this wrapper assigns itself after reducing them, where autograd
        never computes one (a gradient it does compute came around the reduction: see
        :mod:`wrapperroute.arrivals`); None where gradients reach the wrapper's reduction through autograd on every
        route (DDP's and ZeRO's hooks on each parameter's accumulation, FSDP1's on its flat parameter) or a read
        outside its forward fails loudly (a 0-element ZeRO-3 partition, FSDP1's 1-D shard)."""
        return None

    def step_count(self, wrapper: nn.Module, optimizer: Any) -> int | None:
        """The wrapper's own count of optimizer steps taken, where it steps the torch ``optimizer`` itself, in
        parts (DeepSpeed's ZeRO optimizer steps its inner one once per parameter group: MoE's dense and expert
        groups, the model half updated in between); None where it does not step that optimizer, or where each of
        its steps is a training step."""
        return None

    def inner_wrappers(self, wrapper: nn.Module) -> tuple[nn.Module, ...]:
        """Wrapper objects this one keeps of its own over the same parameters (composable ``replicate``'s
        ``DistributedDataParallel``): not wrappers of their own to a scan of the process. Default: none."""
        return ()

    def meshes(self, wrapper: nn.Module) -> tuple[Any, ...]:
        """The device meshes this wrapper itself shards or replicates parameters over (FSDP2's, ``replicate``'s),
        so that a tensor-parallel layout on the same parameters is told apart from it. Default: none."""
        return ()


class ArmsInForward(ABC):
    """A wrapper whose gradient synchronisation is armed by its forward, and whose backward without it stays local,
    silently (DDP's reducer, composable ``replicate``): what :func:`~wrapperroute.guard` watches. Sharded
    wrappers fail loudly instead."""

    @abstractmethod
    def syncs_gradients(self, wrapper: nn.Module) -> bool:
        """Whether the next backward is meant to reduce gradients across ranks (False under ``no_sync()`` or
        ``set_requires_gradient_sync(False)``)."""


def replicated(module: nn.Module, copies: tuple[int, ...], grads: bool = True) -> list[Replica]:
    """Every trainable parameter of ``module``, each a copy of the same parameter on the ranks ``copies``."""
    alone = "" if len(copies) > 1 else "one rank in its group"
    return [Replica(name, param, copies, grads, alone) for name, param in module.named_parameters()
            if param.requires_grad]  # fmt: skip


def sharded(module: nn.Module) -> list[Replica]:
    """Every trainable parameter of ``module``, each this rank's own part (FSDP1's flat shards, ZeRO-3's
    partitions): nothing to compare across ranks."""
    rank = dist.get_rank()
    return [Replica(name, param, (rank,), alone="sharded")
            for name, param in module.named_parameters() if param.requires_grad]  # fmt: skip
