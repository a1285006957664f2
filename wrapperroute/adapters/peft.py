"""PEFT's ``PeftModel``: a transparent layer (adapters live inside the base model's modules).

Peeled with PEFT's own ``get_base_model()``, which skips the tuner layer (``LoraModel``...) to the user's
model: what a loss reads. Loaded only once ``peft`` is imported.
"""

from __future__ import annotations

from peft import PeftModel
from torch import nn

from .layer import Layer


class PeftLayer(Layer):
    kind = "peft"

    def claims(self, module: nn.Module) -> bool:
        return isinstance(module, PeftModel)

    def peel(self, module: nn.Module) -> nn.Module:
        base: nn.Module = module.get_base_model()  # type: ignore[operator]
        return base
