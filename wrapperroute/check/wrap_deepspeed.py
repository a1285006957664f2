"""DeepSpeed ZeRO 0-3 on CPU ranks (gloo), configured so its gradients can be compared with a reference.

``gradient_clipping`` is 0 (DeepSpeed's default 1.0 changes gradients) and the optimizer is a plain torch SGD
with the reference's learning rate, so multi-step runs stay comparable. Gradient accumulation follows
DeepSpeed's protocol: ``engine.step()`` after every micro-batch; only the one on the boundary updates.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from .wrappers import Wrapped

_OPTIONS = ("stage", "gradient_accumulation_steps", "zero", "backward", "bf16")


def zero_config(stage: int, gradient_accumulation_steps: int = 1, **zero: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage, **zero},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def build_zero(model: nn.Module, opts: dict[str, Any]) -> Wrapped:
    """opts: ``stage``; ``gradient_accumulation_steps``; ``zero`` (extra ``zero_optimization`` keys, e.g.
    ``{"stage3_param_persistence_threshold": 0}``); ``backward``: ``"engine"`` (default, ``engine.backward``)
    or ``"torch"`` (``loss.backward()``: the engine's forward hooks must do the prologue and GA scaling)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    unknown = set(opts) - set(_OPTIONS)
    if unknown:
        raise ValueError(f"unknown DeepSpeed cell options {sorted(unknown)}; known: {_OPTIONS}")
    gas = int(opts.get("gradient_accumulation_steps", 1))
    config = zero_config(int(opts["stage"]), gas, **opts.get("zero", {}))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)  # as wrappers.sgd_step
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    inner: nn.Module = engine.module
    torch_style = opts.get("backward", "engine") == "torch"

    def backward(loss: torch.Tensor) -> None:
        boundary = engine.is_gradient_accumulation_boundary()
        if torch_style:
            loss.backward()
        else:
            engine.backward(loss)
        if not boundary:
            engine.step()  # advances DeepSpeed's micro-step counter; no update off the boundary

    def full_grads() -> dict[str, torch.Tensor]:
        grads = {}
        for name, param in inner.named_parameters():
            grad = safe_get_full_grad(param)  # a collective under ZeRO-3: every rank, same order
            shape = getattr(param, "ds_shape", param.shape)
            grads[name] = torch.zeros(shape) if grad is None else grad.detach().clone().reshape(shape)
        return grads

    return Wrapped(
        engine,
        inner,
        contextlib.nullcontext,  # accumulation is DeepSpeed's own (gradient_accumulation_steps), not no_sync
        full_grads,
        engine.step,
        backward,
        loss_scale=1.0 / gas,  # engine.backward and its forward hooks divide the loss by the GA steps
    )
