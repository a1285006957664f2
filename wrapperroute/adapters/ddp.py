"""DistributedDataParallel.

``DDP.forward`` arms the reducer: ``_pre_forward`` calls ``prepare_for_forward`` (only when
``require_backward_grad_sync``, which is how ``no_sync()`` works) and ``_post_forward`` calls
``prepare_for_backward`` on the output, walking it for unused parameters when ``find_unused_parameters``.
Routing through ``ddp.__call__`` gets all of that, and every hook on the wrapper, for free.

The functorch fallback (``isolate=True``): ``_run_ddp_forward`` sets ``DDP._active_ddp_module`` and Dynamo,
compiling anything while it is set, swaps in its DDP graph optimizer, which splits graphs at bucket
boundaries. A split inside a ``torch.func`` transform (Liger's chunked losses) fails with "Cannot access
storage of TensorWrapper". Clearing the marker while the loss runs keeps that pass away from the loss alone:
the reducer is armed exactly as before, and compiled code outside the loss keeps the optimizer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .base import NOTHING, Adapter


class DDPAdapter(Adapter):
    kind = "ddp"
    distributed = True

    def claims(self, module: nn.Module) -> bool:
        return isinstance(module, DistributedDataParallel)

    def peel(self, module: nn.Module) -> nn.Module:
        inner: nn.Module = module.module  # type: ignore[assignment]
        return inner

    def in_forward(self, wrapper: nn.Module) -> bool:
        return getattr(DistributedDataParallel, "_active_ddp_module", None) is wrapper

    def describe(self, wrapper: nn.Module) -> dict[str, Any]:
        ddp: DistributedDataParallel = wrapper  # type: ignore[assignment]
        return {
            "find_unused_parameters": ddp.find_unused_parameters,
            "static_graph": ddp.static_graph,
            "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
        }

    def inside(
        self, wrapper: nn.Module, *, isolate: bool, gather: tuple[nn.Module, ...]
    ) -> contextlib.AbstractContextManager[Any]:
        return _without_graph_optimizer() if isolate else NOTHING


@contextlib.contextmanager
def _without_graph_optimizer() -> Iterator[None]:
    # Same save/restore discipline as DDP's own ``_inside_ddp_forward`` (nested DDP).
    previous = DistributedDataParallel._active_ddp_module
    DistributedDataParallel._active_ddp_module = None
    try:
        yield
    finally:
        DistributedDataParallel._active_ddp_module = previous
