"""How to wrap the tiny model in each distributed wrapper, and how to read back full gradients."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._torch_internals import REPLICATE_WITH_FSDP


@dataclass
class Wrapped:
    model: nn.Module  # what the trainer holds
    inner: nn.Module  # what the loss reads
    no_sync: Callable[[], contextlib.AbstractContextManager[Any]]
    full_grads: Callable[[], dict[str, torch.Tensor]]
    step: Callable[[], None]  # optimizer step (+ zero_grad)
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward  # DeepSpeed: engine.backward
    loss_scale: float = 1.0  # gradients are of loss * loss_scale (DeepSpeed divides by its GA steps)
    # Tensor parallelism: ranks of one tensor-parallel group read the same batch. This rank's data-parallel
    # index and the number of data-parallel replicas (None: every rank is one).
    data_rank: int | None = None
    data_world: int | None = None
    twin: nn.Module | None = None  # the one-process reference with the same weights (None: the check's tiny LM)
    # Context parallelism: this rank's part of each sequence, (index, parts); None: whole sequences.
    seq_shard: tuple[int, int] | None = None


def missing_package(requires: str | None) -> str | None:
    """Why a case needing the importable module ``requires`` (a package, or a module of one) cannot run here, or
    None. A package is looked up without importing it."""
    if requires is None:
        return None
    top = requires.split(".")[0]
    if importlib.util.find_spec(top) is None:
        return f"needs the package {top!r}, which is not installed"
    try:
        found = importlib.util.find_spec(requires) is not None
    except ImportError:
        found = False
    return None if found else f"needs {requires!r}, which the installed {top} does not have"


@dataclass(frozen=True)
class WrapperCase:
    """``builder`` is ``"module:function"``, imported on first use so optional packages stay optional."""

    name: str
    builder: str
    requires: str | None = None
    defaults: tuple[tuple[str, Any], ...] = ()  # options merged under the cell's own
    cpu_torch: tuple[tuple[int, int], str] | None = None  # (oldest torch it runs right on CPU/gloo, why)
    min_ranks: int = 2  # fewer ranks make the layout degenerate (HSDP's 2-D mesh, resharding to 2 of 4 ranks)
    losses: tuple[str, ...] | None = None  # the only losses this layout runs (a sharded head needs vocab_* ones)
    accumulation_option: str | None = None  # the builder option that takes the cell's micro-batches per step

    def unavailable(self, nproc: int | None = None) -> str | None:
        """Why this wrapper cannot be checked here (on CPU ranks; on ``nproc`` of them, if given), or None."""
        if nproc is not None and nproc < self.min_ranks:
            return f"needs at least {self.min_ranks} ranks (--nproc {self.min_ranks})"
        missing = missing_package(self.requires)
        if missing is not None:
            return missing
        if self.cpu_torch is not None and torch_version() < self.cpu_torch[0]:
            major, minor = self.cpu_torch[0]
            return f"needs torch >= {major}.{minor} on CPU ranks, this is {torch.__version__}: {self.cpu_torch[1]}"
        return None

    def available(self) -> bool:
        return self.unavailable() is None

    def runs(self, loss: str) -> bool:
        """Whether this layout runs ``loss`` (a head sharded on the vocabulary runs the vocabulary-parallel ones)."""
        return self.losses is None or loss in self.losses

    def build(self, model: nn.Module, opts: dict[str, Any]) -> Wrapped:
        module_name, function_name = self.builder.split(":")
        build: Callable[[nn.Module, dict[str, Any]], Wrapped] = getattr(
            importlib.import_module(module_name), function_name
        )
        return build(model, {**dict(self.defaults), **opts})


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def _replicated_grads(inner: nn.Module) -> Callable[[], dict[str, torch.Tensor]]:
    def grads() -> dict[str, torch.Tensor]:
        return {
            name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for name, p in inner.named_parameters()
        }

    return grads


def sgd_step(params: Iterator[nn.Parameter]) -> Callable[[], None]:
    optimizer = torch.optim.SGD(params, lr=0.5)

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def build_none(model: nn.Module, opts: dict[str, Any]) -> Wrapped:
    return Wrapped(model, model, contextlib.nullcontext, _replicated_grads(model), sgd_step(model.parameters()))


def build_ddp(model: nn.Module, opts: dict[str, Any]) -> Wrapped:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, **opts)
    return Wrapped(ddp, model, ddp.no_sync, _replicated_grads(model), sgd_step(ddp.parameters()))


@contextlib.contextmanager
def gradient_sync_off(module: Any) -> Iterator[None]:
    """``no_sync()`` for the wrappers that are the module itself (composable replicate, FSDP2)."""
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def build_replicate(model: nn.Module, opts: dict[str, Any]) -> Wrapped:
    """torch's composable ``replicate()`` (DDP with no wrapper object); opts are DDP's."""
    from .._torch_internals import composable_replicate

    composable_replicate()(model, **opts)
    no_sync = functools.partial(gradient_sync_off, model)
    return Wrapped(model, model, no_sync, _replicated_grads(model), sgd_step(model.parameters()))


def build_fabric(model: nn.Module, opts: dict[str, Any]) -> Wrapped:
    """Lightning Fabric over the ranks already running: ``strategy`` (default "ddp"), ``precision``. The loss
    reads ``fabric_module.module`` (the user's model), the pattern that bypasses Fabric's forward."""
    import os

    import torch.distributed as dist
    from lightning.fabric import Fabric

    # Fabric reads the launcher's variables (a Lightning Trainer's teardown removes them): set from the group.
    rank, world = str(dist.get_rank()), str(dist.get_world_size())
    os.environ.update(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world)
    fabric = Fabric(
        accelerator="cpu",
        devices=dist.get_world_size(),
        strategy=opts.get("strategy", "ddp"),
        precision=opts.get("precision", "32-true"),
    )
    # LOCAL_RANK is set, so Fabric's environment creates no processes; the process group exists already, so
    # launch() only sets up the strategy.
    fabric.launch()
    module = fabric.setup_module(model)
    optimizer: Any = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.5))

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    inner: nn.Module = module.module
    no_sync = lambda: fabric.no_backward_sync(module)  # noqa: E731
    return Wrapped(module, inner, no_sync, _replicated_grads(inner), step, fabric.backward)


# The losses that read a head sharded on the vocabulary: wrapperroute.losses' primitives.
VOCAB_LOSSES = ("vocab_ce", "vocab_dpo")
# The token-level losses: a sequence cut over context-parallel ranks is scored token by token.
TOKEN_LOSSES = ("fused_ce", "backbone_ce", "vocab_ce")

WRAPPERS: dict[str, WrapperCase] = {
    "none": WrapperCase("none", f"{__name__}:build_none"),
    "ddp": WrapperCase("ddp", f"{__name__}:build_ddp"),
    "replicate": WrapperCase("replicate", f"{__name__}:build_replicate"),
    "fabric_ddp": WrapperCase("fabric_ddp", f"{__name__}:build_fabric", "lightning"),
    "fsdp1": WrapperCase("fsdp1", "wrapperroute.check.wrap_fsdp:build_fsdp1"),
    "fsdp1_hybrid": WrapperCase(
        "fsdp1_hybrid", "wrapperroute.check.wrap_fsdp:build_fsdp1", defaults=(("hybrid", True),), min_ranks=4
    ),
    "fsdp2": WrapperCase(
        "fsdp2",
        "wrapperroute.check.wrap_fsdp:build_fsdp2",
        # Measured (.ci/compat): fully_shard on CPU ranks needs CUDA in 2.4 (torch.cuda.Stream), fails in 2.6
        # (Stream.record_event), and in 2.7 and 2.8 sums gradients over gloo instead of averaging them: 2x a
        # plain model(...) step's, routed or not. Right in 2.9.1 and 2.13.0. (2.5 not measured.)
        cpu_torch=((2, 9), "before 2.9, fully_shard on gloo fails or sums gradients instead of averaging them"),
    ),
    "fsdp2_units": WrapperCase(
        "fsdp2_units",
        "wrapperroute.check.wrap_fsdp:build_fsdp2",
        defaults=(("groups", "layers"),),  # every block and the head their own units: the head read outside its own
        cpu_torch=((2, 9), "before 2.9, fully_shard on gloo fails or sums gradients instead of averaging them"),
    ),
    "replicate_fsdp": WrapperCase(
        "replicate_fsdp",
        "wrapperroute.check.wrap_fsdp:build_replicate_fsdp",
        REPLICATE_WITH_FSDP,
    ),
    **{
        name: WrapperCase(
            name,
            "wrapperroute.check.wrap_fsdp:build_fsdp2",
            defaults=defaults,
            cpu_torch=((2, 9), "before 2.9, fully_shard on gloo fails or sums gradients instead of averaging them"),
            min_ranks=4,
        )
        for name, defaults in (
            ("hsdp", (("hsdp", True), ("groups", "layers"))),
            ("fsdp2_tail", (("groups", "tail"),)),
            ("fsdp2_keep", (("groups", "layers"), ("reshard", False))),
            ("fsdp2_reshard2", (("groups", "layers"), ("reshard", 2))),
        )
    },
    "dp2_cp2": WrapperCase(
        "dp2_cp2",
        "wrapperroute.check.wrap_fsdp:build_fsdp2_cp",
        defaults=(("cp", 2),),
        min_ranks=4,
        losses=TOKEN_LOSSES,
        cpu_torch=((2, 9), "before 2.9, fully_shard on gloo fails or sums gradients instead of averaging them"),
    ),
    **{
        name: WrapperCase(
            name, "wrapperroute.check.wrap_tp:build_tp", defaults=defaults, min_ranks=4, losses=VOCAB_LOSSES
        )
        for name, defaults in (
            ("tp2_dp2", (("tp", 2),)),
            ("tp2_hsdp", (("tp", 2), ("hsdp", True))),
            ("tp4", (("tp", 4),)),
        )
    },
    **{
        name: WrapperCase(
            name,
            "wrapperroute.check.wrap_tp:build_hf_tp",
            "transformers.distributed",
            defaults=(("tp", tp),),
            min_ranks=4,
            losses=VOCAB_LOSSES,
        )
        for name, tp in (("hf_tp2_fsdp2", 2), ("hf_tp4", 4))
    },
    **{
        f"zero{stage}": WrapperCase(
            f"zero{stage}",
            "wrapperroute.check.wrap_deepspeed:build_zero",
            "deepspeed",
            (("stage", stage),),
            accumulation_option="gradient_accumulation_steps",
        )
        for stage in range(4)
    },
}
