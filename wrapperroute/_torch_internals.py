"""Every private torch name wrapperroute touches outside its adapters, in one place: what each is for, and where
it was checked. torch may rename any of them in a release; a test (``tests/test_internals.py``) keeps them here.

Checked: torch 2.13.0 (CI, every name); 2.4.1 and 2.9.1 (``.ci/compat``, 2026-12-03, the names then in use:
all below but the marked ones). ``pyproject.toml`` admits torch >= 2.4.

=================================================  ==========================================================
name                                               what for
=================================================  ==========================================================
``torch._C._autograd._saved_tensors_hooks_*``      a compile that failed inside a ``torch.func`` transform
                                                   leaves saved-tensor hooks disabled: read and re-enabled
                                                   (the functorch fallback, the TRL check's cell reset)
``torch.autograd.Variable._execution_engine``      ``guard``: a callback at the end of the running backward
``torch.autocast._enabled``, ``._cache_enabled``   the autocast an instance forward entered (accelerate's AMP),
                                                   entered again around the loss
``torch._foreach_norm``                            one fused kernel for every tensor's signature (cross-rank
                                                   comparisons)
``torch.distributed._composable.contract``         ``REGISTRY_KEY``: composable state no adapter claims
``torch.distributed._composable.replicate``        ``replicate()`` for the check's layouts
``torch.distributed._composable.fsdp``,            FSDP2's names before torch 2.6 (the check's layouts)
``torch.distributed._tensor``
``torch._dynamo.reset``                            a check cell compiling a loss afresh inside the wrapper
``DistributedDataParallel._active_ddp_module``     the TRL check's cell reset of a marker a crashed cell left
FSDP1 ``FlatParameter`` ``_fqns`` ... (2.13 only)  the check cutting a unit's gathered flat gradient back into
                                                   its parameters
=================================================  ==========================================================
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch.distributed._composable.contract import REGISTRY_KEY as _REGISTRY_KEY

# --- autograd ---------------------------------------------------------------------------------------------------

# Called before every routed step (only its error path reads it): the C function itself, not a wrapper.
saved_tensor_hooks_enabled: Callable[[], bool] = getattr(
    torch._C._autograd, "_saved_tensors_hooks_is_enabled", lambda: True
)


def enable_saved_tensor_hooks() -> None:
    torch._C._autograd._saved_tensors_hooks_enable()


def at_end_of_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the backward now running ends."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def autocast_settings(cast: torch.autocast) -> tuple[str, torch.dtype, bool, bool]:
    """``(device_type, dtype, enabled, cache_enabled)`` of an autocast instance, to enter an equal one."""
    return cast.device, cast.fast_dtype, cast._enabled, cast._cache_enabled


def foreach_norm(tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Each tensor's L2 norm, one fused kernel for the list (same dtype and device); ``dtype``: accumulated and
    returned in that dtype, no widened copy made (a torch whose kernel lacks ``dtype`` gets the copies)."""
    if dtype is None or all(tensor.dtype == dtype for tensor in tensors):
        return list(torch._foreach_norm(tensors))
    try:
        return list(torch._foreach_norm(tensors, 2, dtype=dtype))
    except (TypeError, RuntimeError):
        return list(torch._foreach_norm([tensor.to(dtype) for tensor in tensors]))


def reset_dynamo() -> None:
    """Drop every compiled graph, so a loss is compiled afresh (inside the wrapper it runs in)."""
    torch._dynamo.reset()


# --- torch.distributed ------------------------------------------------------------------------------------------


# The module attribute under which torch's composable APIs (replicate, fully_shard, checkpoint) record themselves.
COMPOSABLE_REGISTRY_KEY: str = _REGISTRY_KEY


def composable_replicate() -> Any:
    """torch's composable ``replicate()`` (DDP without a wrapper object)."""
    from torch.distributed._composable.replicate import replicate

    return replicate


def replicate_with_fsdp() -> Any:
    """``replicate()`` built on FSDP2 (torch >= 2.10)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    return replicate


REPLICATE_WITH_FSDP = "torch.distributed._composable.replicate_with_fsdp"  # absent from older torch


class Fsdp2Api(NamedTuple):
    FSDPModule: Any
    MixedPrecisionPolicy: Any
    fully_shard: Any
    DTensor: Any


def fsdp2_api() -> Fsdp2Api:
    """FSDP2's names wherever this torch keeps them (public since torch 2.6, ``DTensor`` since 2.5; under
    ``_composable.fsdp`` and ``_tensor`` before)."""
    try:
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import (  # type: ignore[no-redef,unused-ignore]
            FSDPModule,
            MixedPrecisionPolicy,
            fully_shard,
        )
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor  # type: ignore[no-redef,unused-ignore]
    return Fsdp2Api(FSDPModule, MixedPrecisionPolicy, fully_shard, DTensor)


def loaded_class(*where: str) -> Any:
    """The class at the first of ``where`` ("module:Name") whose module is loaded already, else None: what to test a
    module against without importing its package, since no instance of a class can exist before its module is
    loaded (FSDP's packages import DTensor's, over half a second in every process that imports wrapperroute).
    Remembered once found: adapters ask on every routed call."""
    found = _loaded.get(where)
    if found is not None:
        return found
    for place in where:
        module_name, name = place.split(":")
        module = sys.modules.get(module_name)
        found = getattr(module, name, None) if module is not None else None
        if found is not None:
            _loaded[where] = found
            return found
    return None


_loaded: dict[tuple[str, ...], Any] = {}


def dynamo_disabled_lazily(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` never traced by Dynamo, as ``torch.compiler.disable(fn)``, Dynamo imported on its first call rather
    than now (``torch._disable_dynamo``, torch's own lazy form; the eager one where a release lacks it)."""
    lazy = getattr(torch, "_disable_dynamo", None)
    return lazy(fn) if lazy is not None else torch.compiler.disable(fn)


def ddp_forward_marker() -> Any:
    """The DDP whose forward Dynamo believes is running (its graph optimizer applies while set)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel._active_ddp_module


def clear_ddp_forward_marker() -> None:
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._active_ddp_module = None


class FlatPiece(NamedTuple):
    """One stretch of an FSDP1 flat parameter: an original parameter (its name under the unit, shape), or
    alignment padding (``name`` None)."""

    name: str | None
    shape: tuple[int, ...]
    numel: int


def fsdp1_flat_units(fsdp: Any) -> Iterator[tuple[Any, Any, list[FlatPiece]]]:
    """For every FSDP1 unit of ``fsdp`` holding a flat parameter: the unit, the flat parameter and its padded
    layout, in order."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    for unit in FullyShardedDataParallel.fsdp_modules(fsdp):
        handle = unit._handle
        if handle is None:
            continue
        flat = handle.flat_param
        params = iter(zip(flat._fqns, flat._shapes, strict=True))
        pieces = []
        for numel, padding in zip(flat._numels_with_padding, flat._is_padding_mask, strict=True):
            if padding:
                pieces.append(FlatPiece(None, (numel,), numel))
            else:
                name, shape = next(params)
                pieces.append(FlatPiece(name, tuple(shape), numel))
        yield unit, flat, pieces


def fsdp1_local_shard(flat: Any) -> torch.Tensor:
    """This rank's shard of a flat parameter, also where a forward left the unit unsharded."""
    shard: torch.Tensor = getattr(flat, "_local_shard", flat)
    return shard
