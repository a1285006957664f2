"""Rank bodies for tests/test_pipeline.py (module level: the pool pickles them by reference): the tiny model cut
into pipeline stages, run by torch's schedules with ``PipelineLoss``, every gradient of every stage against one
process on the global batch (4 micro-batches of uneven valid tokens on every data-parallel replica)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from wrapperroute import PipelineLoss, RouteStateError, RouteValueError
from wrapperroute.check.cell import CellResult
from wrapperroute.check.models import TinyConfig, build_model, stage_pieces
from wrapperroute.check.pipeline_cell import (
    CONFIG,
    IGNORE,
    Path,
    PipelineCase,
    PipelineCell,
    batch,
    inner,
    place,
    run_pipeline_cell,
    wrap,
)

MICRO = 4


def run(schedule: str, layout: str, path: Path = "routed", steps: int = 1) -> CellResult:
    """``steps`` steps of ``schedule`` on ``layout`` (``pipeline_cell.PipelineCase``) by ``path``: its error, if any,
    and the largest difference of any gradient of this rank's stages from one process on the global batch."""
    case = PipelineCase(f"{layout}_{schedule}", schedule, layout, "vocab_ce" if layout == "pp2_tp2" else "fused_ce")
    return run_pipeline_cell(PipelineCell(case, path, steps, MICRO))


def misuse() -> None:
    """``PipelineLoss`` called on a stage that is not the last, called before ``begin_step``, or given a schedule
    that scales the gradients itself: a clear error on the rank concerned, before any collective."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    model = build_model(CONFIG)
    index = dist.get_rank()
    stage = PipelineStage(stage_pieces(model, 2)[index], index, 2, torch.device("cpu"))
    loss = PipelineLoss(stage, lambda output, target: output.sum())
    scaled = ScheduleGPipe(stage, n_microbatches=MICRO, loss_fn=loss)  # scale_grads=True by default
    try:
        loss.begin_step(10, scaled)
    except RouteValueError as error:
        assert "scale_grads=False" in str(error), error
    else:
        raise AssertionError("a schedule scaling the gradients itself was taken")
    output, target = torch.zeros(1, CONFIG.seq, CONFIG.hidden), torch.zeros(1, CONFIG.seq, dtype=torch.long)
    if index == 0:
        try:
            loss(output, target)
        except RouteValueError as error:
            assert "not the last" in str(error), error
        else:
            raise AssertionError("the first stage computed a loss")
    else:
        try:
            loss(output, target)
        except RouteStateError as error:
            assert "begin_step" in str(error), error
        else:
            raise AssertionError("a loss without the step's divisor")
        loss.begin_step(torch.tensor(10))
        assert float(loss(output, target)) == 0.0


def bare_after_the_stage(layout: str) -> str | None:
    """What a schedule's bare ``loss_fn`` meets on the last stage: the stage module's forward has run and
    returned, and the loss reads the head's weight. The error it raises there, or None (no schedule runs: a
    crashed last stage would leave the first waiting for its gradients)."""
    model = build_model(CONFIG)
    where = place(layout)
    module = wrap(stage_pieces(model, 2)[where.coordinate], layout, where.other)
    if where.coordinate == 0:
        return None
    _, labels = batch(where.replica, 0, MICRO)
    output = module(torch.randn(MICRO, CONFIG.seq, CONFIG.hidden))
    try:
        logits = output.flatten(0, 1) @ inner(module).lm_head.weight.t()
        F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE, reduction="sum").backward()
    except RuntimeError as error:
        return str(error)
    return None


def tied_embedding(fixed: bool) -> dict[str, Any]:
    """The embedding on the first stage and the head on the last share one weight in the model (``tied``); each
    rank keeps its own stage, so its own copy. Natively each copy gets its own stage's part of the gradient only;
    ``fixed``: the two parts summed between the two stages after the step (what docs/pipeline.md tells a user to
    write). Returns the tied weight's gradient's difference from one process."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    config = TinyConfig(tied=True)
    model = build_model(config)
    index = dist.get_rank()
    part = stage_pieces(model, 2)[index]
    tied = part.embed.weight if index == 0 else part.lm_head.weight  # type: ignore[union-attr]

    def summed(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = output.flatten(0, 1) @ part.lm_head.weight.t()  # type: ignore[union-attr]
        return F.cross_entropy(logits, target.flatten(), ignore_index=IGNORE, reduction="sum")

    stage = PipelineStage(part, index, 2, torch.device("cpu"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = PipelineLoss(stage, summed)
    said = [str(w.message) for w in caught if "tied across stages" in str(w.message)]
    # the model this rank cut its stage from is alive: the other stage's module holding the weight is seen
    assert len(said) == 1 and ("Embedding.weight" if index == 1 else "Linear.weight") in said[0], said
    schedule = Schedule1F1B(stage, n_microbatches=MICRO, loss_fn=loss, scale_grads=False)
    ids, labels = batch(0, 0, MICRO)
    loss.begin_step((labels != IGNORE).sum(), schedule)
    schedule.step(*((ids,) if index == 0 else ()), target=labels if index == 1 else None)
    if fixed:  # the tie across stages: its gradient is the sum of both stages' parts (Megatron's embedding group)
        dist.all_reduce(tied.grad, group=None)  # type: ignore[arg-type]  # the first and last stage's ranks
    reference = build_model(config)
    total = int((labels != IGNORE).sum())
    logits = reference(ids).flatten(0, 1) @ reference.lm_head.weight.t()
    (F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE, reduction="sum") / total).backward()
    return {"diff": float((tied.grad - reference.embed.weight.grad).abs().max())}  # type: ignore[operator]
