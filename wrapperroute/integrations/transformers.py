"""transformers' ``Trainer``: the divisor of a summed loss in a ``compute_loss`` of your own.

The ``Trainer`` hands ``compute_loss`` the number of valid labels of the whole optimizer step,
``num_items_in_batch`` (summed over every process when ``average_tokens_across_devices``, its default), and then
scales what ``compute_loss`` returns by rules of its own, which changed across releases (read in the source of
every transformers release from 4.56 to 5.24):

- its own ``compute_loss`` multiplies a loss normalised by ``num_items_in_batch`` by the number of processes
  (over the tensor-parallel size from 5.10), to undo the wrapper's mean: an override does not get this;
- ``training_step`` divides the loss by the step's micro-batches unless the loss counts as scaled for them:
  ``loss_is_scaled_for_ga`` where set (5.19 and later), else when the model accepts loss keyword arguments and
  ``num_items_in_batch`` is given, or a ``compute_loss_func`` is set;
- accelerate's ``backward`` divides by its own accumulation steps outside DeepSpeed (transformers 5.2 to 5.4 set
  them to the Trainer's: a second division), and under DeepSpeed the Trainer calls
  ``engine.backward(loss, scale_wrt_gas=False)``, so the engine does not divide.

:func:`trainer_token_divisor` reads each of these off the running trainer (its flags, its accelerator, its
wrapper's averaging), never off a version number, so that ``loss_sum / trainer_token_divisor(self,
num_items_in_batch)`` is exactly the mean over every valid token of the step's global batch.

This module imports neither transformers nor accelerate: it reads the objects it is given.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from ..errors import RouteValueError
from ..tokens import averaging_of, divisor

__all__ = ["trainer_token_divisor"]


def trainer_token_divisor(trainer: Any, num_items_in_batch: int | torch.Tensor | None) -> torch.Tensor:
    """The divisor of a loss summed over the micro-batch's valid tokens, in a ``Trainer`` subclass's
    ``compute_loss`` (``@routed`` or not): return ``loss_sum / trainer_token_divisor(self, num_items_in_batch)``.

    Counts what the Trainer counts: ``num_items_in_batch`` is its count of the labels that are not ``-100``
    (over ``labels[..., 1:]`` for a causal language model from transformers 5.10, over every label before: sum
    your loss over the same positions). Already summed over the processes (``average_tokens_across_devices``):
    used as it is; else summed over the ranks the wrapper reduces gradients over (one all-reduce). Then divided by
    what the wrapper divides the gradients' sum by, and multiplied by what the Trainer and accelerate will divide
    the returned loss by (see the module's docstring). Call it on every rank, on every micro-batch.

    Raises :class:`~wrapperroute.RouteValueError` when the Trainer passed no count (it counts only when the batch
    has ``labels`` and the model's ``forward`` accepts ``**kwargs`` or a ``compute_loss_func`` is set).
    """
    if num_items_in_batch is None:
        raise RouteValueError(
            f"{type(trainer).__name__} passed num_items_in_batch=None: transformers' Trainer counts the step's tokens "
            "only when the batch has 'labels' and the model's forward accepts **kwargs (model_accepts_loss_kwargs) "
            "or a compute_loss_func is set. Set self.model_accepts_loss_kwargs = True after the Trainer's "
            "__init__, or count the step's tokens yourself and use wrapperroute.token_divisor."
        )
    args, accelerator = trainer.args, trainer.accelerator
    averaging = averaging_of(trainer.model_wrapped)
    if bool(getattr(args, "average_tokens_across_devices", False)) and int(getattr(args, "world_size", 1)) > 1:
        averaging = dataclasses.replace(averaging, ranks=(dist.get_rank(),), group=None)  # summed already
    deepspeed = str(getattr(accelerator, "distributed_type", "")).upper().endswith("DEEPSPEED")
    later = _trainer_divides_by(trainer, num_items_in_batch)
    if not deepspeed:  # accelerate's backward divides by its accumulation steps; DeepSpeed's engine is told not to
        later *= float(getattr(accelerator, "gradient_accumulation_steps", 1) or 1)
    return divisor(num_items_in_batch, dataclasses.replace(averaging, backward_divides_by=later))


def _trainer_divides_by(trainer: Any, num_items_in_batch: Any) -> float:
    """What ``Trainer.training_step`` divides the returned loss by: its micro-batches per step, unless the loss
    counts as scaled for them."""
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:
        scaled = (bool(getattr(trainer, "model_accepts_loss_kwargs", False)) and num_items_in_batch is not None) or (
            getattr(trainer, "compute_loss_func", None) is not None
        )
    steps = getattr(trainer, "current_gradient_accumulation_steps", None) or trainer.args.gradient_accumulation_steps
    return 1.0 if scaled else float(steps)
