"""Rank bodies for tests/test_reliability.py, one module per theme; this module holds what the themes share.

- ``faults``: fn raising on every rank, Ctrl-C at every point of a call, one rank failing (with and without
  ``agree``);
- ``inputs``: mistakes made against real wrappers, and odd but legitimate uses;
- ``lifetime``: long runs, and routed models freed with their last reference;
- ``concurrency``: routing from two threads of each rank;
- ``edge_cases``: a gather iterator under ``agree``, two wrappers over one module, an instance forward put
  back, a plain call in another thread, a model sharded after its first call.

Each body asserts its facts where it finds them, each ``assert`` saying what broke, and returns nothing: a
failure reaches the test as the rank's ``RankAssertionError`` naming that line. Every expected exception is
caught in the bodies, so the happy path never restarts the pool. (Module level: the pool pickles the bodies by
reference.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from wrapperroute import detect, route_loss
from wrapperroute.check.cell import REFERENCE_TOLERANCE, differing_across_ranks, max_grad_diff
from wrapperroute.check.losses import LOSSES, make_batch
from wrapperroute.check.models import TinyConfig, build_model
from wrapperroute.check.wrappers import WRAPPERS, Wrapped, build_none

CONFIG = TinyConfig()
_HOOKS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def hook_count(module: nn.Module) -> int:
    return sum(len(getattr(m, name, ())) for m in module.modules() for name in _HOOKS)


def snapshot(wrapped: Wrapped) -> dict[str, Any]:
    """What routing must leave exactly as it found it."""
    found = detect(wrapped.model)
    assert found.wrapper is not None and found.adapter is not None, f"no wrapper found on {type(wrapped.model)}"
    target = found.adapter.redirect_target(found.wrapper)
    from torch.nn.parallel import DistributedDataParallel as DDP

    return {
        "sharded": _sharded(found.kind, found.wrapper),
        "target_forward": "forward" in target.__dict__,
        "wrapper_forward": found.wrapper is not target and "forward" in found.wrapper.__dict__,
        "hooks": hook_count(wrapped.model),
        "in_forward": found.adapter.marks_forward(found.wrapper),
        "active_ddp": DDP._active_ddp_module is not None,
        "grad_enabled": torch.is_grad_enabled(),
    }


def _sharded(kind: str, wrapper: nn.Module) -> bool:
    """Every parameter is back in its between-steps layout (trivially so for replicated wrappers)."""
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        flats = [unit._handle.flat_param for unit in FSDP.fsdp_modules(wrapper) if unit._handle is not None]
        # before the first forward (lazy init) the flat parameter is its own shard
        return all(not hasattr(f, "_local_shard") or f.data_ptr() == f._local_shard.data_ptr() for f in flats)
    if kind in ("fsdp2", "replicate_fsdp"):
        from wrapperroute.check.wrap_fsdp import fsdp2_api

        DTensor = fsdp2_api().DTensor

        return all(isinstance(p, DTensor) for p in wrapper.parameters())
    if kind == "deepspeed" and wrapper.zero_optimization_stage() == 3:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        return all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in wrapper.module.parameters())
    return True


def changed(before: dict[str, Any], after: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """What differs between two snapshots: ``{key: (before, after)}``."""
    return {key: (before.get(key), after.get(key)) for key in before.keys() | after.keys()
            if before.get(key) != after.get(key)}  # fmt: skip


def truth_step(wrapped: Wrapped, reference: Wrapped, step: int, config: TinyConfig = CONFIG, after: str = "") -> None:
    """One routed fused-CE step, asserted exact: every parameter's gradient the same on every rank and within
    REFERENCE_TOLERANCE of a single process's on the global batch. ``after``: what came before it, for the
    message."""
    case = LOSSES["fused_ce"]
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = make_batch(case, config, rank, step, 0)
    loss = route_loss(wrapped.model, wrapped.inner, case.compute, wrapped.inner, batch, {})
    wrapped.backward(loss)
    grads = wrapped.full_grads()
    differ, _ = differing_across_ranks(grads)
    batches = [make_batch(case, config, r, step, 0) for r in range(world)]
    (case.compute(reference.model, case.concat(batches), {}) * wrapped.loss_scale).backward()  # type: ignore[arg-type]
    ref_diff = max_grad_diff(grads, reference.full_grads())
    wrapped.step()
    reference.step()
    where = f"{type(wrapped.model).__name__}, routed step {step}" + (f" after {after}" if after else "")
    assert grads, f"{where}: no gradient to compare"
    assert differ == 0, f"{where}: {differ} of {len(grads)} parameters' gradients differ across ranks"
    assert ref_diff <= REFERENCE_TOLERANCE, (
        f"{where}: gradients {ref_diff:.3g} from one process's on the global batch (tolerance {REFERENCE_TOLERANCE})"
    )


def build(wrapper: str, opts: dict[str, Any] | None = None, config: TinyConfig = CONFIG) -> tuple[Wrapped, Wrapped]:
    return WRAPPERS[wrapper].build(build_model(config), dict(opts or {})), build_none(build_model(config), {})
