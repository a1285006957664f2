"""The private names of other packages that wrapperroute reaches, and helpers over some of torch's.

``PRIVATE_NAMES`` is the catalogue: every private name of another package (torch, DeepSpeed, TRL, accelerate,
Lightning, Python's own) that the code of ``wrapperroute/`` touches anywhere, with whose it is and what it is for.
Their owners may rename or drop any of them in a release. ``tests/test_internals.py`` reads the code's syntax tree
and fails on a name reached but not here, and on a name here no longer reached.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch.distributed._composable.contract import REGISTRY_KEY as _REGISTRY_KEY

# Grouped by owner. A name two owners share is described once, under the first.
PRIVATE_NAMES: dict[str, str] = {
    # --- Python -------------------------------------------------------------------------------------------------------
    "_exit": "os: a rank worker or audited run leaves without interpreter teardown, where gloo's shutdown can abort",
    "_getframe": "sys: the caller's frame, where this thread's stack is read for a wrapper forward running",
    "_current_frames": "sys: every thread's stack, so a wrapper is repaired only while no thread runs its forward",
    "_run_exitfuncs": "atexit: the exit handlers, run by hand before an audited run's os._exit",
    "_run_finalizers": "multiprocessing.util: a rank worker's finalizers, run before os._exit to release semaphores",
    "_replace": "NamedTuple (public despite its underscore): a routed call's Around with one field changed",
    # --- torch: autograd, autocast, kernels, Dynamo -------------------------------------------------------------------
    "_C": "torch: the C extension, the way to autograd's saved-tensor hooks switch",
    "_autograd": "torch._C: autograd's C functions, the saved-tensor hooks switch among them",
    "_saved_tensors_hooks_is_enabled": "torch._C._autograd: read around a routed call, to see a compile that failed "
    "inside a torch.func transform leave saved-tensor hooks off",
    "_saved_tensors_hooks_enable": "torch._C._autograd: turns them back on (routing's fallback, a check cell's reset)",
    "_execution_engine": "torch.autograd.Variable: queue_callback, to reset the gradient-sync check as a backward ends",
    "_enabled": "torch.autocast: whether an instance forward's autocast (accelerate's AMP) is on, entered again around "
    "the loss",
    "_cache_enabled": "torch.autocast: the same autocast's weight-cache setting",
    "_foreach_norm": "torch: every tensor's L2 norm in one fused kernel (the cross-rank signatures)",
    "_dynamo": "torch: Dynamo, reset for a check cell compiling a loss afresh; its eval_frame module holds "
    "OptimizedModule",
    "_disable_dynamo": "torch: torch.compiler.disable's lazy form, so Dynamo is imported at route_loss's first call",
    "_orig_mod": "torch.compile's OptimizedModule: the module it compiles, which the compile layer peels to",
    # --- torch: nn.Module ---------------------------------------------------------------------------------------------
    "_call_impl": "torch nn.Module: its code object marks the frame of a module's __call__ in a thread's stack",
    "_parameters": "torch nn.Module: the parameter dict, where DeepSpeed ZeRO-3 flags a running forward",
    "_forward_pre_hooks": "torch nn.Module: a hook dict set aside while a loss runs inside the forward, put back after",
    "_forward_pre_hooks_with_kwargs": "torch nn.Module: which pre-hooks take keyword arguments, aside too",
    "_forward_hooks": "torch nn.Module: a hook dict set aside while a loss runs inside the forward, put back after",
    "_forward_hooks_with_kwargs": "torch nn.Module: which forward hooks take keyword arguments, aside too",
    "_forward_hooks_always_called": "torch nn.Module: which forward hooks run though the forward raises, aside too",
    # --- torch.distributed: DDP, composable replicate(), DTensor ------------------------------------------------------
    "_active_ddp_module": "torch DDP: the class attribute naming the DDP whose forward runs; Dynamo's graph optimizer "
    "applies while set: read as the forward's mark, cleared around an isolated loss and when left stale",
    "_run_ddp_forward": "torch DDP: the method whose frame, found by name in a thread's stack, proves a DDP forward",
    "_find_tensors": "torch DDP: find_unused_parameters' walk of the output, to refuse a loss DDP cannot reach",
    "_comm_hooks": "torch DDP: its communication hooks, to say when one not of torch's may scale the gradients",
    "_composable": "torch.distributed: contract's REGISTRY_KEY, replicate(), replicate_with_fsdp, FSDP2 before 2.6",
    "_ddp": "torch replicate(): the DDP its state builds in the module's first forward",
    "_init_kwargs": "torch replicate(): the arguments recorded for that DDP, read before it is built",
    "_no_sync": "torch replicate(): set while set_requires_gradient_sync(False) holds",
    "_tensor": "torch.distributed: DTensor's home before torch 2.5",
    # --- torch.distributed: FSDP1 -------------------------------------------------------------------------------------
    "_fsdp_wrapped_module": "torch FSDP1: the module a unit wraps, whose forward a routed loss is redirected into",
    "_handle": "torch FSDP1: a unit's flat-parameter handle (its training state, its flat parameter)",
    "_training_state": "torch FSDP1 handle, FSDP2 state and parameter group: FORWARD while a forward runs, the "
    "wrapper's mark; set back to IDLE after a failed forward",
    "_use_orig_params": "torch FSDP1: use_orig_params, reported by describe",
    "_all_fsdp_states": "torch FSDP1: every unit's state under the root, each reset after a failed forward",
    "_common_utils": "torch FSDP1: the module holding TrainingState and HandleTrainingState",
    "_runtime_utils": "torch FSDP1: the module holding _reshard",
    "_reshard": "torch FSDP1: frees a unit's unsharded flat parameter after a failed forward, as post-backward does",
    "_prefetched": "torch FSDP1 handle: a per-iteration flag, reset after a failed forward",
    "_needs_pre_backward_unshard": "torch FSDP1 handle: a per-iteration flag, reset after a failed forward",
    "_post_forward_index": "torch FSDP1 handle: its place in the forward order, cleared after a failed forward",
    "_gradient_predivide_factor": "torch FSDP1: what it divides gradients by before the reduction",
    "_gradient_postdivide_factor": "torch FSDP1: what it divides gradients by after the reduction",
    "_comm_hook": "torch FSDP1: its communication hook, to say when one not of torch's may scale the gradients",
    "_inter_node_pg": "torch FSDP1 hybrid sharding: the replicating group, for the ranks gradients average over",
    "_device_mesh": "torch FSDP1 hybrid sharding: the mesh it was given, for the same ranks",
    "_fqns": "torch FSDP1 FlatParameter: its parameters' names, to cut a gathered flat gradient apart (the check)",
    "_shapes": "torch FSDP1 FlatParameter: its parameters' shapes, likewise",
    "_numels_with_padding": "torch FSDP1 FlatParameter: the sizes of its pieces, padding included, likewise",
    "_is_padding_mask": "torch FSDP1 FlatParameter: which of its pieces are padding, likewise",
    "_local_shard": "torch FSDP1 FlatParameter: this rank's shard, also where a forward left the unit unsharded",
    # --- torch.distributed: FSDP2 -------------------------------------------------------------------------------------
    "_get_fsdp_state": "torch FSDP2 FSDPModule: its state (training state, parameter groups, hooks)",
    "_lazy_init": "torch FSDP2 state: the root's lazy init, run as its forward would before holding parameters whole",
    "_state_ctx": "torch FSDP2 state: what every state under the root shares (all_states, the iteration's trackers)",
    "_comm_ctx": "torch FSDP2 state: its post_forward_order, cleared after a failed forward so ranks prefetch alike",
    "_fsdp_param_groups": "torch FSDP2 state: its parameter groups (torch >= 2.6)",
    "_fsdp_param_group": "torch FSDP2 state: its one parameter group (torch < 2.6)",
    "_post_forward_indices": "torch FSDP2 parameter group: cleared after a failed forward, without reset_iter_state",
    "_partial_reduce_output": "torch FSDP2 parameter group: HSDP's partial reduction, kept across reset_iter_state",
    "_unsharded_param": "torch FSDP2 FSDPParam: the unsharded form a forward holds, mapped to its sharded parameter",
    "_all_reduce_hook": "torch FSDP2 parameter group: set_all_reduce_hook's hook, said to scale gradients unread",
    "_pre_forward_hook_handle": "torch FSDP2 state: its pre-forward hook, kept while other hooks are set aside",
    "_post_forward_hook_handle": "torch FSDP2 state: its post-forward hook, kept while other hooks are set aside",
    # --- DeepSpeed ----------------------------------------------------------------------------------------------------
    "_in_forward": "DeepSpeed ZeRO-3: the flag its forward prologue sets on every module's parameter dict",
    "_forward_epilogue": "DeepSpeed engine: run after a failed ZeRO-3 forward, which skipped it",
    "_external_params": "DeepSpeed ZeRO-3: a module's external parameters, to register the head with the root once",
    "_invalidate_trace": "DeepSpeed ZeRO-3 parameter coordinator: drops a fetch trace once the root fetches more",
    # --- TRL ----------------------------------------------------------------------------------------------------------
    "_ForwardRedirection": "TRL: the class trainers route a forward through, replaced by wrapperroute's while patched",
    "_forward_redirection": "TRL trainer: its _ForwardRedirection, replaced where built before patch_trl; the check "
    "reads it",
    "_compute_loss_liger": "TRL trainer: its Liger loss, patched to receive the unwrapped model",
    "_get_liger_zero3_lm_head_gather_ctx": "TRL trainer: its ZeRO-3 gather of the heads, patched to enter when the "
    "routed loss runs",
    # --- accelerate ---------------------------------------------------------------------------------------------------
    "_reset_state": "accelerate AcceleratorState: reset around each TRL check cell, so none inherits the last's",
    "_shared_state": "accelerate PartialState: its distributed_type, set to FSDP for an FSDP check cell on CPU",
    # --- Lightning ----------------------------------------------------------------------------------------------------
    "_FabricModule": "Lightning Fabric: the class setup_module returns, a layer routed through",
    "_forward_module": "Lightning Fabric _FabricModule: the strategy's wrapper inside it, which the layer peels to",
}

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


# Where FSDP2 lives: public since torch 2.6, under ``_composable`` before. The adapter tells a unit by the first
# home's ``FSDPModule`` found loaded; the check's layouts import ``fully_shard`` from the first that has it.
FSDP2_HOMES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")


def fsdp2_api() -> Fsdp2Api:
    """FSDP2's names wherever this torch keeps them (``FSDP2_HOMES``; ``DTensor`` public since 2.5, under
    ``_tensor`` before)."""
    import importlib

    fsdp = importlib.import_module(FSDP2_HOMES[0])
    if not hasattr(fsdp, "fully_shard"):  # torch < 2.6
        fsdp = importlib.import_module(FSDP2_HOMES[1])
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor  # type: ignore[no-redef,unused-ignore]
    return Fsdp2Api(fsdp.FSDPModule, fsdp.MixedPrecisionPolicy, fsdp.fully_shard, DTensor)


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
