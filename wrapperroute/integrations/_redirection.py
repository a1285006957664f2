"""TRL's ``_ForwardRedirection``, backed by :func:`wrapperroute.route_loss`. Never imports TRL."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._routing.swap import MISSING
from ..detect import detect
from ..route import Mode, route_loss
from ._router_loss import warn_if_router_loss_dropped


class ForwardRedirection:
    """Drop-in for TRL's ``_ForwardRedirection``, backed by :func:`wrapperroute.route_loss`.

    ``redirection(wrapper_module, original_module, method, *args, **kwargs)`` returns
    ``method(*args, **kwargs)`` computed inside ``wrapper_module``'s forward, like TRL's (Lightning's) class,
    and keeps its ``on_after_inner_forward``/``on_after_outer_forward`` hooks. Unlike it:

    - the module's ``forward`` is restored even when the wrapper or ``method`` raises, and no instance
      ``forward`` attribute is left behind;
    - a compiled ``torch.func`` method (Liger's chunked losses) that DDP's graph optimizer cannot split is
      rerun isolated from that optimizer (``mode="auto"``, see :func:`route_loss`);
    - for wrappers wrapperroute knows (DDP, FSDP1/2, DeepSpeed, under ``torch.compile`` too), the arguments
      reach ``method`` untouched: they are not moved or cast by the wrapper. Unknown wrappers get TRL's
      behaviour (arguments through the wrapper), with the restore above.
    """

    def __init__(self, mode: Mode = "auto") -> None:
        self.mode: Mode = mode

    def __call__(
        self, wrapper_module: nn.Module, original_module: nn.Module, method: Callable[..., Any], *args: Any,
        **kwargs: Any,
    ) -> Any:  # fmt: skip
        owner = getattr(method, "__self__", None)
        defined_in = getattr(getattr(method, "__func__", None), "__module__", None) or ""
        if owner is not None and defined_in.startswith("trl.") and torch.is_grad_enabled():
            # TRL redirects a loss computed from the backbone's hidden states (its chunked distillation losses)
            warn_if_router_loss_dropped(owner, original_module, defined_in)
        found = detect(wrapper_module)
        if any(layer is original_module for layer in found.layers):
            # A partial keys route_loss's functorch fallback on ``method`` itself; a closure (only when a subclass
            # hooks in after the inner call) would share one key between every method redirected.
            fn: Callable[[], Any] = functools.partial(method, *args, **kwargs)
            if type(self).on_after_inner_forward is not ForwardRedirection.on_after_inner_forward:
                fn = functools.partial(self._then_inner_hook, wrapper_module, original_module, fn)
            output = route_loss(wrapper_module, original_module, fn, mode=self.mode)
        else:
            output = self._through_unknown(wrapper_module, original_module, method, args, kwargs)
        self.on_after_outer_forward(wrapper_module, original_module)
        return output

    def _then_inner_hook(self, wrapper: nn.Module, original: nn.Module, call: Callable[[], Any]) -> Any:
        out = call()
        self.on_after_inner_forward(wrapper, original)
        return out

    def _through_unknown(
        self, wrapper: nn.Module, original: nn.Module, method: Callable[..., Any], args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:  # fmt: skip
        """TRL's redirection, for a wrapper wrapperroute does not know, plus restore-on-exception."""
        saved = original.__dict__.get("forward", MISSING)

        def restore() -> None:
            if saved is MISSING:
                original.__dict__.pop("forward", None)
            else:
                original.__dict__["forward"] = saved

        def forward(*inner_args: Any, **inner_kwargs: Any) -> Any:
            restore()  # before ``method``: it may call the real forward itself
            out = method(*inner_args, **inner_kwargs)
            self.on_after_inner_forward(wrapper, original)
            return out

        original.__dict__["forward"] = forward
        try:
            return wrapper(*args, **kwargs)
        finally:
            restore()

    def on_after_inner_forward(self, wrapper_module: nn.Module, original_module: nn.Module) -> None:
        pass

    def on_after_outer_forward(self, wrapper_module: nn.Module, original_module: nn.Module) -> None:
        pass
