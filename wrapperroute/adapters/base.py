"""The one protocol every wrapper family implements.

A *layer* is anything that can sit between the object a trainer holds and the module that owns the
parameters: ``torch.compile``'s ``OptimizedModule``, DDP, FSDP1, FSDP2, a DeepSpeed engine, a PEFT model.
Only *distributed* layers need routing; the others are peeled so :func:`wrapperroute.detect` can see through
them.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

from torch import nn

NOTHING = contextlib.nullcontext()  # reusable and re-entrant: the default ``inside``


class Adapter:
    """Knows one wrapper family. Subclasses override what differs; the defaults fit a transparent layer.

    kind
        Short stable name reported by :func:`wrapperroute.detect` (``"ddp"``, ``"compile"``...).
    distributed
        True when the layer's forward arms gradient synchronisation or gathers parameters, i.e. when a loss
        must run *inside* its forward.
    """

    kind: ClassVar[str] = "?"
    distributed: ClassVar[bool] = False

    def claims(self, module: nn.Module) -> bool:
        """Whether ``module`` is a layer of this family."""
        raise NotImplementedError

    def peel(self, module: nn.Module) -> nn.Module:
        """The next module inward. A layer that *is* the model (FSDP2) returns ``module`` itself."""
        raise NotImplementedError

    # The verbs below are only used for distributed layers.

    def redirect_target(self, wrapper: nn.Module) -> nn.Module:
        """The module whose ``forward`` the wrapper's forward calls: its forward is swapped for the loss."""
        return self.peel(wrapper)

    def in_forward(self, wrapper: nn.Module) -> bool:
        """Whether the wrapper's own forward is running right now (routing again would re-enter it)."""
        return False

    def describe(self, wrapper: nn.Module) -> dict[str, Any]:
        """Extra facts for :class:`~wrapperroute.Detection` (e.g. the ZeRO stage)."""
        return {}

    def inside(
        self, wrapper: nn.Module, *, isolate: bool, gather: tuple[nn.Module, ...]
    ) -> contextlib.AbstractContextManager[Any]:
        """Context entered inside the wrapper's forward, around the loss (on every step: keep it cheap).

        ``isolate``: keep wrapper-specific compiler passes away from the loss (the functorch fallback).
        ``gather``: modules whose parameters the loss reads directly and that must be whole while it runs.
        """
        return NOTHING

    def nested_units(self, wrapper: nn.Module, gather: tuple[nn.Module, ...]) -> tuple[nn.Module, ...]:
        """Shard units below the wrapper whose forward must also run for the loss (outermost first).

        ``gather`` names the modules the loss reads; when empty, a sharded wrapper may pick them itself.
        """
        return ()

    def validate_gather(self, wrapper: nn.Module, gather: tuple[nn.Module, ...]) -> None:
        """Reject ``gather=`` entries this wrapper cannot honour.

        The default accepts any: a replicated wrapper (DDP) holds every parameter whole already, so code that
        passes the same ``gather=`` under every wrapper keeps working.
        """
