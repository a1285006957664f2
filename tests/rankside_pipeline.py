"""Rank bodies for tests/test_pipeline.py (module level: the pool pickles them by reference): the tiny model cut
into pipeline stages, run by torch's schedules with ``PipelineLoss``, every gradient of every stage against one
process on the global batch (4 micro-batches of uneven valid tokens on every data-parallel replica)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from wrapperroute import PipelineLoss, RouteStateError, RouteValueError
from wrapperroute.check.models import StagePiece, TinyConfig, build_model, stage_pieces
from wrapperroute.losses import linear_cross_entropy

CONFIG = TinyConfig()
IGNORE = -100
MICRO = 4
MULTI = ("interleaved", "zbv")  # two stages per rank


def batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A data-parallel replica's batch of ``MICRO`` rows (one a micro-batch), a different number of valid tokens in
    every row, replica and step."""
    generator = torch.Generator().manual_seed(100 * step + replica)
    ids = torch.randint(0, CONFIG.vocab, (MICRO, CONFIG.seq), generator=generator)
    labels = torch.roll(ids, -1, 1)
    for row in range(MICRO):
        labels[row, : (replica + 2 * row + step) % (CONFIG.seq - 1)] = IGNORE
    return ids, labels


def inner(module: nn.Module) -> Any:
    return getattr(module, "module", module)  # DDP's inner module; FSDP2's is the module itself


def layout_of(layout: str) -> tuple[int, int, Any, Any]:
    """(pipeline coordinate, data-parallel replica, pipeline group, the other mesh dimension) of this rank: ``pp2``
    on 2 ranks; ``pp2_fsdp2``, ``pp2_ddp``: a (pp, dp) mesh on 4; ``pp2_tp2``: a (pp, tp) mesh on 4, the ranks of
    a tensor-parallel group reading one batch."""
    if layout == "pp2":
        return dist.get_rank(), 0, None, None
    from torch.distributed.device_mesh import init_device_mesh

    second = "tp" if layout == "pp2_tp2" else "dp"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", second))
    replica = 0 if second == "tp" else mesh.get_local_rank("dp")
    return mesh.get_local_rank("pp"), replica, mesh["pp"].get_group(), mesh[second]


def wrap(piece: StagePiece, layout: str, dp_mesh: Any) -> nn.Module:
    """FSDP2 inside the stage (each block and the head their own units), DDP over its replicas, or as it is."""
    if layout in ("pp2_fsdp2", "pp2_fsdp2_root"):
        from torch.distributed.fsdp import fully_shard

        for block in piece.blocks:
            fully_shard(block, mesh=dp_mesh)
        if piece.lm_head is not None and layout == "pp2_fsdp2":
            fully_shard(piece.lm_head, mesh=dp_mesh)
        return fully_shard(piece, mesh=dp_mesh)  # type: ignore[no-any-return]
    if layout == "pp2_ddp":
        return nn.parallel.DistributedDataParallel(piece, process_group=dp_mesh.get_group())
    if layout == "pp2_tp2" and piece.lm_head is not None:  # the head split on the vocabulary over tp
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        parallelize_module(piece, dp_mesh, {"lm_head": ColwiseParallel(use_local_output=False)})
    return piece


def run(schedule_name: str, layout: str, how: str = "routed", steps: int = 1) -> dict[str, Any]:
    """``steps`` steps of the schedule; ``how``: ``routed`` (PipelineLoss), ``bare`` (the summed loss over the
    same divisor, read outside the stage's forward), ``mean`` (each micro-batch's own mean, the schedule scaling by
    their number: its default). Returns the error, if any, and the largest difference of any gradient of this
    rank's stages from one process on the global batch (mean over every valid token of the step)."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleZBVZeroBubble,
    )  # fmt: skip

    model = build_model(CONFIG)
    parts = stage_pieces(model, 4 if schedule_name in MULTI else 2)
    count = len(parts)
    coordinate, replica, pp_group, dp_mesh = layout_of(layout)
    held = {"zbv": [coordinate, count - 1 - coordinate], "interleaved": [coordinate, coordinate + 2]}.get(
        schedule_name, [coordinate]
    )
    full_names = {id(param): name for name, param in model.named_parameters()}
    # each held stage's parameter names, as the full model names them (taken before wrapping replaces them)
    names = {i: {name: full_names[id(param)] for name, param in parts[i].named_parameters()} for i in held}
    modules = {index: wrap(parts[index], layout, dp_mesh) for index in held}
    last = modules.get(count - 1)

    def summed(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        weight = inner(last).lm_head.weight  # type: ignore[arg-type]
        if layout == "pp2_tp2":  # the vocabulary-parallel head read as it is
            return linear_cross_entropy(output.flatten(0, 1), weight, target.flatten(), reduction="sum")
        logits = output.flatten(0, 1) @ weight.t()
        return F.cross_entropy(logits, target.flatten(), ignore_index=IGNORE, reduction="sum")

    routed = PipelineLoss(stages := [PipelineStage(modules[i], i, count, torch.device("cpu"), group=pp_group)
                                     for i in held], summed)  # fmt: skip

    def bare(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return summed(output, target) / routed.divisor  # type: ignore[operator]

    def mean(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = output.flatten(0, 1) @ inner(last).lm_head.weight.t()  # type: ignore[arg-type]
        return F.cross_entropy(logits, target.flatten(), ignore_index=IGNORE)

    loss_fn = {"routed": routed, "bare": bare, "mean": mean}[how]
    kinds = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
             "zbv": ScheduleZBVZeroBubble}  # fmt: skip
    schedule = kinds[schedule_name](stages if schedule_name in MULTI else stages[0], n_microbatches=MICRO,
                                    loss_fn=loss_fn, scale_grads=how == "mean")  # fmt: skip
    reference = build_model(CONFIG)
    replicas = 1 if dp_mesh is None or layout == "pp2_tp2" else dp_mesh.size()
    error = None
    for step in range(steps):
        ids, labels = batch(replica, step)
        routed.begin_step((labels != IGNORE).sum(), None if how == "mean" else schedule)
        try:
            inputs = (ids,) if 0 in modules else ()
            schedule.step(*inputs, target=labels if last is not None else None)
        except Exception as raised:
            error = f"{type(raised).__name__}: {raised}"
            break
        everyone = [batch(r, step) for r in range(replicas)]
        total = sum(int((labels != IGNORE).sum()) for _, labels in everyone)
        for ids, labels in everyone:
            logits = reference(ids).flatten(0, 1) @ reference.lm_head.weight.t()
            (F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE, reduction="sum") / total).backward()
    worst = 0.0
    if error is None:
        truth = dict(reference.named_parameters())
        for index, module in modules.items():
            for name, param in inner(module).named_parameters():
                grad: Any = param.grad
                grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
                worst = max(worst, float((grad - truth[names[index][name]].grad).abs().max()))  # type: ignore[operator]
    return {"error": error, "worst": worst, "stages": held}


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
    coordinate, replica, _, dp_mesh = layout_of(layout)
    module = wrap(stage_pieces(model, 2)[coordinate], layout, dp_mesh)
    if coordinate == 0:
        return None
    _, labels = batch(replica, 0)
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
    ids, labels = batch(0, 0)
    loss.begin_step((labels != IGNORE).sum(), schedule)
    schedule.step(*((ids,) if index == 0 else ()), target=labels if index == 1 else None)
    if fixed:  # the tie across stages: its gradient is the sum of both stages' parts (Megatron's embedding group)
        dist.all_reduce(tied.grad, group=None)  # type: ignore[arg-type]  # the first and last stage's ranks
    reference = build_model(config)
    total = int((labels != IGNORE).sum())
    logits = reference(ids).flatten(0, 1) @ reference.lm_head.weight.t()
    (F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE, reduction="sum") / total).backward()
    return {"diff": float((tied.grad - reference.embed.weight.grad).abs().max())}  # type: ignore[operator]
