"""A pipeline's loss: the schedule's ``loss_fn`` for ``torch.distributed.pipelining``, exact on the last stage.

A schedule (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ``ScheduleZBVZeroBubble``, ...) calls
``loss_fn(output, target)`` on the last stage once per micro-batch, outside the stage module's forward. A fused
loss there reads the head's weight outside its wrapper's forward: with FSDP2 inside the stage and the head in its
own unit, a sharded ``DTensor`` ("aten.mm.default got mixed torch.Tensor and DTensor", pytorch/pytorch#180426).
And with ``scale_grads=True`` (the default) the schedule divides the gradients by the number of micro-batches:
with a mean per micro-batch, that is the mean over the step's valid tokens only when every micro-batch holds as
many (torchtitan #2972).

:class:`PipelineLoss` is the supported way: each micro-batch's summed loss runs inside the last stage module's
wrapper's forward (:func:`~wrapperroute.route_loss`, the head's unit gathered), divided by the step's
:func:`~wrapperroute.token_divisor` over the last stage's data-parallel ranks, with the schedule's own scaling
off (``scale_grads=False``): every token of the step weighs one over their number, whatever the micro-batches
and replicas hold.
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import tokens
from .adapters import Averaging
from .detect import detect
from .errors import RouteStateError, RouteValueError
from .route import route_loss

__all__ = ["PipelineLoss"]


class PipelineLoss:
    """The schedule's ``loss_fn`` for a pipeline whose last stage computes a summed loss::

        loss = PipelineLoss(stages, summed_ce)          # stages: this rank's PipelineStage(s)
        schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=loss, scale_grads=False)
        for ids, labels in data:
            loss.begin_step((labels != -100).sum(), schedule)   # every rank, before the step
            schedule.step(...)

    ``summed(output, target)`` is one micro-batch's loss summed over its valid tokens (or sequences), computed
    from the last stage's output and module (its head's weight read directly: a fused loss); ``gather``: the
    modules it reads that live in their own FSDP unit or ZeRO-3 partition (found by itself for the output
    embedding, as for :func:`~wrapperroute.route_loss`). Built on every rank, called by the schedule on the last
    stage only; called on any other stage it raises :class:`~wrapperroute.RouteValueError`, with no collective
    started.
    """

    def __init__(
        self, stages: Any, summed: Callable[[Any, Any], torch.Tensor], *,
        gather: nn.Module | Iterable[nn.Module] | None = None,
    ) -> None:  # fmt: skip
        if not callable(summed):
            raise RouteValueError(f"summed must be the loss function (output, target) -> tensor, got {summed!r}")
        mine: Sequence[Any] = stages if isinstance(stages, list | tuple) else [stages]
        for stage in mine:
            if not hasattr(stage, "is_last") or not isinstance(getattr(stage, "submod", None), nn.Module):
                raise RouteValueError(
                    f"stages must be this rank's torch.distributed.pipelining PipelineStage(s), got {stage!r}"
                )
        self.summed = summed
        self.gather = gather
        self.stages = tuple(mine)
        last = [stage for stage in self.stages if stage.is_last]
        self.stage = last[0] if last else None  # the last stage, where this rank holds it
        self.divisor: torch.Tensor | None = None  # this step's, set by begin_step
        for said in _tied_elsewhere(self.stages):
            warnings.warn(
                f"wrapperroute.PipelineLoss: {said}, a module in none of this rank's stages: a weight tied across "
                "stages gets each stage's part of its gradient only (torch's pipelining does not sum them). Sum its "
                "gradient over the ranks of the stages that hold it after each step (docs/pipeline.md).",
                RuntimeWarning,
                stacklevel=2,
            )

    @property
    def module(self) -> nn.Module | None:
        """The last stage's module, as the stage holds it (a DDP, FSDP2 or plain module), where this rank holds it."""
        return None if self.stage is None else self.stage.submod

    def begin_step(self, count: int | torch.Tensor, schedule: Any = None) -> None:
        """Before each ``schedule.step``, on every rank: ``count`` is this rank's valid tokens (or sequences) of the
        whole step, every micro-batch included. On the last stage's ranks, the step's divisor: the counts summed
        over the ranks the stage module's wrapper reduces together (:func:`~wrapperroute.token_divisor`, a
        collective among them), or the count itself where no data-parallel wrapper holds the stage (each
        replica a rank of its own). ``schedule``: refused when it scales the gradients itself
        (``scale_grads=True``): the divisor already makes the mean."""
        if schedule is not None and getattr(schedule, "scale_grads", False):
            raise RouteValueError(
                f"{type(schedule).__name__} was built with scale_grads=True: it divides the gradients by the number "
                "of micro-batches, on top of the token count this loss divides by. Build it with "
                "scale_grads=False."
            )
        module = self.module
        if module is None:
            return  # not the last stage: no loss here
        if detect(module).distributed:
            self.divisor = tokens.token_divisor(module, count)
        else:  # no wrapper averages this stage's gradients: this rank's count, checked as token_divisor checks it
            self.divisor = tokens.divisor(count, Averaging((dist.get_rank(),), None, 1.0))

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        """One micro-batch's loss over the step's divisor, computed inside the last stage module's wrapper's
        forward."""
        module = self.module
        if module is None:
            held = ", ".join(str(stage.stage_index) for stage in self.stages)
            raise RouteValueError(
                f"this rank holds pipeline stage(s) {held} of {self.stages[0].num_stages}, not the last: only the "
                "last stage computes the loss (the schedule calls loss_fn there)"
            )
        if self.divisor is None:
            raise RouteStateError(
                "PipelineLoss called before begin_step: call loss.begin_step(count, schedule) on every rank before "
                "each schedule.step, with this rank's valid tokens of the whole step"
            )
        if not detect(module).distributed:  # no wrapper holds the stage: nothing to route through
            return self.summed(output, target) / self.divisor
        return route_loss(module, None, self.summed, output, target, gather=self.gather) / self.divisor


def _tied_elsewhere(stages: Sequence[Any]) -> list[str]:
    """Each parameter of this rank's stages that a live module outside them holds too (the embedding a head is tied
    to, when the stages were cut from one model in this process), said in words. One scan of the process's objects,
    once per loss."""
    mine = {id(param): f"stage {stage.stage_index}'s {name}"
            for stage in stages for name, param in stage.submod.named_parameters()}  # fmt: skip
    inside = {id(module) for stage in stages for module in stage.submod.modules()}
    said = []
    for holder in gc.get_objects():
        if issubclass(type(holder), nn.Module) and id(holder) not in inside:  # type(): proxies warn on isinstance
            for name, param in holder.named_parameters(recurse=False, remove_duplicate=False):
                if id(param) in mine:
                    said.append(f"{mine[id(param)]} is also {type(holder).__name__}.{name}")
    return said
