"""How a real TRL trainer is put under each wrapper on local CPU ranks, and how its gradients are read back whole.

- ``ddp``: what the trainer does by itself on CPU ranks (accelerate wraps the model in DDP).
- ``zero3``: DeepSpeed ZeRO-3 through the trainer's own ``deepspeed=`` argument (fp32, no clipping). DeepSpeed
  steps inside ``accelerator.backward``, before any callback, so the gradients are read at the engine's step.
- ``fsdp2``: accelerate's FSDP2 plugin through the trainer's own ``fsdp=`` argument. accelerate never selects
  FSDP on CPU (it keeps the multi-CPU type and wraps in DDP instead), so for the step its state is told FSDP,
  exactly as it is on a GPU machine; everything after that (``fully_shard`` of each decoder layer and the root,
  the trainer's and TRL's FSDP branches) is the installed code's own.
- ``fsdp2_head``: the same, with the output head made an FSDP2 unit alone (``fully_shard(model.lm_head)``, the
  layout torchtitan builds) just before accelerate's FSDP2 preparation, which leaves a module already sharded
  as it is and groups the final norm alone. A fused head read outside its unit's forward gets such a head
  wrong (TRL's ``add_fused_lm_head`` as installed). accelerate's size-based wrap policy, which would give the
  same units, fails on FSDP2 (it shards the base model and then the root around it: measured, accelerate 1.16).
- ``local``: the reference. The model is left unwrapped, so each rank trains on its own shard of the data as
  one process would; the mean of the ranks' gradients is what every data-parallel wrapper must produce.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .wrap_deepspeed import zero_config

LAYOUTS = ("ddp", "zero3", "fsdp2", "fsdp2_head")


def layout_args(layout: str) -> dict[str, Any]:
    """Training arguments that select ``layout``."""
    if layout == "zero3":
        config = zero_config(3)
        config.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto")
        return {"deepspeed": config}
    if layout.startswith("fsdp2"):
        return {"fsdp": "full_shard",
                "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}  # fmt: skip
    return {}


class GradProbe:
    """Trainer callback: every trainable parameter's whole gradient, after the backward and before the
    optimizer (under ZeRO-3: at the engine's step, see :func:`layout`). Reading a sharded gradient whole is a
    collective; every rank reaches these points together."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def __getattr__(self, event: str) -> Callable[..., None]:
        if not event.startswith("on_"):
            raise AttributeError(event)
        return lambda *args, **kwargs: None

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
        if not self.grads:  # ZeRO-3 recorded them already
            self.grads = whole_grads(model)


def whole_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    grads = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        if isinstance(grad, DTensor):
            grad = grad.full_tensor()
        grads[name] = grad.detach().clone().float()
    return grads


@contextlib.contextmanager
def layout(name: str, probe: GradProbe) -> Iterator[None]:
    """The process-wide settings ``name`` needs for one trainer's step, all undone afterwards (a pool worker
    runs many cells): accelerate's shared state is reset first, so no cell inherits the last one's type, and the
    variables the training arguments set (``ACCELERATE_USE_DEEPSPEED``, ``ACCELERATE_USE_FSDP``...) are put back."""
    import os

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=False)
    environ = dict(os.environ)
    # DeepSpeed's ZeRO-3 puts its own autograd function in for F.linear while it partitions a model, and some
    # TRL releases' set-up leaves it in: a later FSDP2 cell's backward would run it on freed storage.
    linear = torch.nn.functional.linear
    undo: list[Callable[[], None]] = []
    try:
        if name.startswith("fsdp2"):
            undo.append(_fsdp_on_cpu())
        if name == "fsdp2_head":
            undo.append(_head_unit_first())
        elif name == "zero3":
            undo.append(_grads_at_engine_step(probe))
        elif name == "local":
            prepare = Accelerator.prepare_model
            Accelerator.prepare_model = lambda self, model, *args, **kwargs: model
            undo.append(lambda: setattr(Accelerator, "prepare_model", prepare))
        yield
    finally:
        for step in reversed(undo):
            step()
        if name == "zero3":  # transformers keeps the ZeRO-3 config process-wide: later models would be partitioned
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
        AcceleratorState._reset_state(reset_partial_state=False)
        os.environ.clear()
        os.environ.update(environ)
        torch.nn.functional.linear = linear


def _fsdp_on_cpu() -> Callable[[], None]:
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def fsdp_state(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = fsdp_state
    return lambda: setattr(AcceleratorState, "__init__", init)


def _head_unit_first() -> Callable[[], None]:
    import accelerate.accelerator as module
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    prepare = module.fsdp2_prepare_model

    def head_first(accelerator: Any, model: torch.nn.Module) -> Any:
        head = model.get_output_embeddings()  # type: ignore[operator]
        fully_shard(head, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        return prepare(accelerator, model)

    module.fsdp2_prepare_model = head_first
    return lambda: setattr(module, "fsdp2_prepare_model", prepare)


def _grads_at_engine_step(probe: GradProbe) -> Callable[[], None]:
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import safe_get_full_grad

    step = DeepSpeedEngine.step

    def recorded_step(engine: Any, *args: Any, **kwargs: Any) -> Any:
        if not probe.grads and engine.is_gradient_accumulation_boundary():
            for name, param in engine.module.named_parameters():
                if param.requires_grad:
                    grad = safe_get_full_grad(param)  # a collective: every rank steps here
                    probe.grads[name] = (torch.zeros(param.ds_shape) if grad is None else grad).detach().clone().float()
        return step(engine, *args, **kwargs)

    DeepSpeedEngine.step = recorded_step
    return lambda: setattr(DeepSpeedEngine, "step", step)
