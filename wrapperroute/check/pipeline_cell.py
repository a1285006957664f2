"""One pipeline cell of the check matrix, run on every rank: the tiny LM cut into stages, run by one of
``torch.distributed.pipelining``'s schedules, its loss on the last stage.

Gradient truth as for the other cells: after each step every gradient of every stage this rank holds is compared
with its data-parallel copies (exactly, every tensor whole) and with one process on the concatenated global batch
(the mean over every valid token of every micro-batch of the step). Every replica's micro-batches hold different
numbers of valid tokens. The paths:

- ``routed``: :class:`wrapperroute.PipelineLoss` as the schedule's ``loss_fn``, ``scale_grads=False``;
- ``bare``: the same summed loss over the same divisor, read after the stage module's forward (what a schedule's
  ``loss_fn`` does by itself);
- ``scaled``: each micro-batch's own mean, the schedule dividing by their number (its default ``scale_grads=True``).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .._groups import group_ranks
from .._torch_internals import fsdp2_api
from ..crossrank import Row, all_gather_bytes, compare
from ..detect import detect
from ..losses import linear_cross_entropy
from ..pipeline import PipelineLoss
from ..route import route_loss
from .cell import CellResult, watch_sharded
from .models import StagePiece, TinyConfig, build_model, stage_pieces
from .wrappers import torch_version

IGNORE = -100
CONFIG = TinyConfig()
# The schedules holding two stages a rank: interleaved 1F1B loops over them, ZBV holds a V (the first and last).
MULTI = ("interleaved", "zbv")
Path = Literal["routed", "bare", "scaled"]


@dataclass(frozen=True)
class PipelineCase:
    """A pipeline layout the check runs: ``schedule`` (gpipe, 1f1b, interleaved, zbv) over ``layout``: ``pp2``
    (plain stages, 2 ranks), ``pp2_fsdp2`` (FSDP2 inside the stages, each block and the head their own units, on
    a (pp 2, dp) mesh), ``pp2_ddp`` (DDP inside), ``pp2_tp2`` (the last stage's head split on the vocabulary over
    a (pp 2, tp) mesh, the tensor-parallel ranks reading one batch)."""

    name: str
    schedule: str
    layout: str
    loss: str = "fused_ce"  # the summed cross-entropy reading the head's weight; vocab_ce on a vocabulary shard
    requires: str | None = None

    @property
    def losses(self) -> tuple[str, ...]:
        return (self.loss,)

    def unavailable(self, nproc: int | None = None) -> str | None:
        """Why this layout cannot run here (on ``nproc`` ranks, if given), or None."""
        if torch_version() < (2, 9):
            return f"needs torch >= 2.9 on CPU ranks, this is {torch.__version__} (pipelining with FSDP2 on gloo)"
        if nproc is not None and self.layout == "pp2" and nproc != 2:
            return "needs exactly 2 ranks (--nproc 2): one stage (or a pair of stages) a rank"
        if nproc is not None and self.layout != "pp2" and nproc != 4:
            return "needs exactly 4 ranks (--nproc 4): a (pp 2, 2) mesh"
        return None

    def available(self) -> bool:
        return self.unavailable() is None

    def runs(self, loss: str) -> bool:
        return loss == self.loss


PIPELINES: dict[str, PipelineCase] = {
    **{f"pp2_{schedule}": PipelineCase(f"pp2_{schedule}", schedule, "pp2")
       for schedule in ("gpipe", "1f1b", "interleaved", "zbv")},
    # torch's own limits choose the schedule (docs/pipeline.md): DDP inside the stages fails natively under GPipe
    "pp2_dp2_fsdp2": PipelineCase("pp2_dp2_fsdp2", "1f1b", "pp2_fsdp2"),
    "pp2_dp2_ddp": PipelineCase("pp2_dp2_ddp", "1f1b", "pp2_ddp"),
    "pp2_tp2": PipelineCase("pp2_tp2", "1f1b", "pp2_tp2", loss="vocab_ce"),
}  # fmt: skip


@dataclass
class PipelineCell:
    case: PipelineCase
    path: Path = "routed"
    steps: int = 1
    micro_batches: int = 4

    def label(self) -> str:
        return f"{self.case.name} ({self.case.schedule}) / {self.case.loss} / {self.path}"


def batch(replica: int, step: int, micro_batches: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A data-parallel replica's step: ``micro_batches`` rows (one a micro-batch), a different number of valid
    tokens in every row, replica and step."""
    generator = torch.Generator().manual_seed(100 * step + replica)
    ids = torch.randint(0, CONFIG.vocab, (micro_batches, CONFIG.seq), generator=generator)
    labels = torch.roll(ids, -1, 1)
    for row in range(micro_batches):
        labels[row, : (replica + 2 * row + step) % (CONFIG.seq - 1)] = IGNORE
    return ids, labels


@dataclass
class Mesh:
    """This rank's place: its pipeline coordinate, its data-parallel replica (the batch it reads), the pipeline
    group, and the other mesh dimension (data- or tensor-parallel), None on plain ``pp2``."""

    coordinate: int
    replica: int
    pp_group: Any
    other: Any


def place(layout: str) -> Mesh:
    if layout == "pp2":
        return Mesh(dist.get_rank(), 0, None, None)
    from torch.distributed.device_mesh import init_device_mesh

    second = "tp" if layout == "pp2_tp2" else "dp"
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("pp", second))
    replica = 0 if second == "tp" else mesh.get_local_rank("dp")
    return Mesh(mesh.get_local_rank("pp"), replica, mesh["pp"].get_group(), mesh[second])


def wrap(piece: StagePiece, layout: str, mesh: Any) -> nn.Module:
    """FSDP2 inside the stage (each block and the head their own units; ``pp2_fsdp2_root``: the head in the stage's
    root group), DDP over its replicas, the head split on the vocabulary, or the piece as it is."""
    if layout in ("pp2_fsdp2", "pp2_fsdp2_root"):
        fully_shard = fsdp2_api().fully_shard
        for block in piece.blocks:
            fully_shard(block, mesh=mesh)
        if piece.lm_head is not None and layout == "pp2_fsdp2":
            fully_shard(piece.lm_head, mesh=mesh)
        return fully_shard(piece, mesh=mesh)
    if layout == "pp2_ddp":
        return nn.parallel.DistributedDataParallel(piece, process_group=mesh.get_group())
    if layout == "pp2_tp2" and piece.lm_head is not None:
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        parallelize_module(piece, mesh, {"lm_head": ColwiseParallel(use_local_output=False)})
    return piece


def inner(module: nn.Module) -> Any:
    """The stage's own module: DDP's ``module``; FSDP2's is the module itself."""
    return getattr(module, "module", module)


def _schedule(name: str) -> Any:
    from torch.distributed import pipelining

    kinds = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B,
             "interleaved": pipelining.ScheduleInterleaved1F1B, "zbv": pipelining.ScheduleZBVZeroBubble}  # fmt: skip
    return kinds[name]


def run_pipeline_cell(cell: PipelineCell) -> CellResult:
    """Run ``cell`` on this rank; every rank must call it. An error inside a step is reported, not raised."""
    from torch.distributed.pipelining import PipelineStage

    case = cell.case
    result = CellResult(cell.label(), dist.get_rank())
    start = time.perf_counter()
    model = build_model(CONFIG)
    parts = stage_pieces(model, 4 if case.schedule in MULTI else 2)
    count = len(parts)
    where = place(case.layout)
    held = {"zbv": [where.coordinate, count - 1 - where.coordinate],
            "interleaved": [where.coordinate, where.coordinate + 2]}.get(case.schedule, [where.coordinate])  # fmt: skip
    full_names = {id(param): name for name, param in model.named_parameters()}
    # each held stage's parameter names as the whole model names them, taken before wrapping replaces them
    names = {i: {name: full_names[id(param)] for name, param in parts[i].named_parameters()} for i in held}
    modules = {index: wrap(parts[index], case.layout, where.other) for index in held}
    watches = [watch for module in modules.values() if (watch := watch_sharded(module)) is not None]
    last = modules.get(count - 1)

    def summed(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        weight = inner(last).lm_head.weight  # type: ignore[arg-type]
        if case.loss == "vocab_ce":  # the vocabulary-parallel head read as it is
            return linear_cross_entropy(output.flatten(0, 1), weight, target.flatten(), reduction="sum")
        logits = output.flatten(0, 1) @ weight.t()
        return F.cross_entropy(logits, target.flatten(), ignore_index=IGNORE, reduction="sum")

    stages = [PipelineStage(modules[i], i, count, torch.device("cpu"), group=where.pp_group) for i in held]
    routed = PipelineLoss(stages, summed)

    def bare(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return summed(output, target) / routed.divisor  # type: ignore[operator]

    def own_mean(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return summed(output, target) / (target != IGNORE).sum()

    def scaled(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Each micro-batch's own mean, inside the stage's wrapper where one holds it: only the scaling differs."""
        assert last is not None  # the schedule calls its loss_fn on the last stage only
        inside = detect(last).distributed
        return route_loss(last, None, own_mean, output, target) if inside else own_mean(output, target)

    loss_fn = {"routed": routed, "bare": bare, "scaled": scaled}[cell.path]
    schedule = _schedule(case.schedule)(stages if case.schedule in MULTI else stages[0],
                                        n_microbatches=cell.micro_batches, loss_fn=loss_fn,
                                        scale_grads=cell.path == "scaled")  # fmt: skip
    if cell.path == "bare" and (crash := _bare_crash(last, summed)) is not None:
        result.error = crash
        result.seconds = time.perf_counter() - start
        return result
    reference = build_model(CONFIG)
    replicas = 1 if where.other is None or case.layout == "pp2_tp2" else where.other.size()
    copies = group_ranks(where.other.get_group()) if where.other is not None else (dist.get_rank(),)
    for step in range(cell.steps):
        ids, labels = batch(where.replica, step, cell.micro_batches)
        routed.begin_step((labels != IGNORE).sum(), None if cell.path == "scaled" else schedule)
        try:
            schedule.step(*((ids,) if 0 in modules else ()), target=labels if last is not None else None)
        except Exception:
            result.error = traceback.format_exc(limit=-8)
            break
        for watch in watches:
            result.bypassed += [name for name in watch.look()[1] if name not in result.bypassed]
        everyone = [batch(r, step, cell.micro_batches) for r in range(replicas)]
        total = sum(int((labels != IGNORE).sum()) for _, labels in everyone)
        for ids, labels in everyone:
            logits = reference(ids).flatten(0, 1) @ reference.lm_head.weight.t()
            (F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE, reduction="sum") / total).backward()
        truth = dict(reference.named_parameters())
        rows = []
        for index, module in modules.items():
            for name, param in inner(module).named_parameters():
                grad = param.grad if param.grad is not None else torch.zeros_like(param)
                grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
                rows.append(Row(names[index][name], grad.detach(), copies))
                diff = float((grad - truth[names[index][name]].grad).abs().max())  # type: ignore[operator]
                result.max_ref_diff = max(result.max_ref_diff, diff)
        outcome = compare(rows, whole=True)
        result.params = len(rows)
        result.differ = max(result.differ, len(outcome.mismatches))
        result.max_rank_diff = max([result.max_rank_diff, *(m.max_abs_diff for m in outcome.mismatches)])
        with torch.no_grad():  # one plain SGD step on both, so the next step starts from new weights
            for module in modules.values():
                for param in inner(module).parameters():
                    if param.grad is not None:
                        param -= 0.5 * param.grad
                    param.grad = None
            for param in reference.parameters():
                param -= 0.5 * param.grad  # type: ignore[operator,misc]
                param.grad = None
    result.seconds = time.perf_counter() - start
    return result


def _bare_crash(last: nn.Module | None, summed: Any) -> str | None:
    """The error the bare loss meets on the last stage, sent to every rank, or None. Tried on one micro-batch
    before the schedule runs: a last stage crashing inside ``schedule.step`` leaves the first stages waiting for
    its gradients until gloo's timeout."""
    error = None
    if last is not None:
        try:
            output = last(torch.randn(2, CONFIG.seq, CONFIG.hidden))
            summed(output, torch.zeros(2, CONFIG.seq, dtype=torch.long)).backward()
        except Exception:
            error = traceback.format_exc(limit=-8)
        for param in last.parameters():
            param.grad = None
    said = all_gather_bytes((error or "").encode(), None, torch.device("cpu"))
    return next((text.decode() for text in said if text), None)
