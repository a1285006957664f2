"""``torch.compile(module)`` returns an ``OptimizedModule``: a transparent layer."""

from __future__ import annotations

from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

from .base import Layer


class CompileLayer(Layer):
    kind = "compile"

    def claims(self, module: nn.Module) -> bool:
        return isinstance(module, OptimizedModule)

    def peel(self, module: nn.Module) -> nn.Module:
        inner: nn.Module = module._orig_mod  # type: ignore[assignment]
        return inner
