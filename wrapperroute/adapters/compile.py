"""``torch.compile(module)`` returns an ``OptimizedModule``: a transparent layer."""

from __future__ import annotations

import sys

from torch import nn

from .layer import Layer


class CompileLayer(Layer):
    kind = "compile"

    def claims(self, module: nn.Module) -> bool:
        # An OptimizedModule exists only once torch.compile has imported Dynamo: read from there, never imported
        # here (Dynamo, sympy and triton take over a second to import, in every rank of every run).
        eval_frame = sys.modules.get("torch._dynamo.eval_frame")
        return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)

    def peel(self, module: nn.Module) -> nn.Module:
        inner: nn.Module = module._orig_mod  # type: ignore[assignment]
        return inner
