"""Lightning Fabric's ``_FabricModule`` (what ``fabric.setup_module(model)`` returns).

Not distributed itself: its ``forward`` casts the inputs and enters the precision plugin's
``forward_context()`` (``precision="bf16-mixed"``: autocast), then calls ``_forward_module``, the strategy's
wrapper (``DistributedDataParallel`` for ``strategy="ddp"``, FSDP, a DeepSpeed engine) or, on one device, the
user's module. A loss must see what a normal forward sees, so it *enters*: ``route_loss`` calls the
``_FabricModule`` itself, and the wrapper inside it runs as usual around the loss.

Peeled to ``_forward_module``, so :func:`wrapperroute.detect` reports the wrapper inside (``kind == "ddp"``).
Loaded only once ``lightning`` (or the standalone ``lightning_fabric``) is imported.
"""

from __future__ import annotations

import importlib

from torch import nn

from .routing import Routing


class FabricAdapter(Routing):
    kind = "fabric"
    package = "lightning.fabric"

    def __init__(self) -> None:
        self._module_type: type = importlib.import_module(f"{self.package}.wrappers")._FabricModule

    def claims(self, module: nn.Module) -> bool:
        return isinstance(module, self._module_type)

    def peel(self, module: nn.Module) -> nn.Module:
        inner: nn.Module = module._forward_module  # type: ignore[assignment]
        return inner


class StandaloneFabricAdapter(FabricAdapter):
    """The same layer from the standalone ``lightning_fabric`` package (a class of its own)."""

    package = "lightning_fabric"
