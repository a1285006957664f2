"""A layer: anything that can sit between the object a trainer holds and the module that owns the parameters
(``torch.compile``'s ``OptimizedModule``, DDP, FSDP1, FSDP2, a DeepSpeed engine, a PEFT model, a Lightning Fabric
module). Every adapter is one; one that is nothing more (compile, PEFT) is only peeled, so
:func:`wrapperroute.detect` sees through it. What else an adapter is, it says by the protocols it has:
:class:`~wrapperroute.adapters.routing.Routing` (route_loss enters it) and
:class:`~wrapperroute.adapters.topology.Topology` (which ranks hold copies, how gradients are averaged).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from torch import nn


class Layer(ABC):
    """Knows one layer family: how to tell one of its modules and the module inside it.

    kind
        Short stable name reported by :func:`wrapperroute.detect` (``"compile"``, ``"ddp"``...).
    """

    kind: ClassVar[str] = "?"

    @abstractmethod
    def claims(self, module: nn.Module) -> bool:
        """Whether ``module`` is a layer of this family: an ``isinstance`` check (its answer depends on the type
        alone: a type no layer claims is remembered as plain)."""

    @abstractmethod
    def peel(self, module: nn.Module) -> nn.Module:
        """The next module inward. A layer that *is* the model (FSDP2) returns ``module`` itself."""
