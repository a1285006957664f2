"""DeepSpeed's ``DeepSpeedEngine`` (ZeRO stages 0-3). Loaded only once ``deepspeed`` is imported.

``engine.forward`` calls ``engine.module``, whose forward hooks run the engine's prologue and epilogue (under
ZeRO-3 the prologue marks every module ``_in_forward``, so reading a partitioned parameter as an attribute gathers
it and registers it with the running module, whose backward hooks gather it again and reduce-scatter its
gradient; ZeRO-3's root hook also restarts its parameter-fetch trace), then hooks the *output*: the first
gradient reaching it runs the backward prologue, and each is divided by ``gradient_accumulation_steps`` unless
``engine.backward`` already scaled the loss. Routing the loss through ``engine(call)`` puts all of that around
the loss, exactly as a normal forward. ZeRO 0/1/2 reduce in ``backward``/``step`` whatever the forward did; the
forward still matters there for the output hooks. While the loss runs, ``engine.module``'s hooks are set aside
(``_hooks.py``): a loss that calls the model again gets a plain forward, not a second prologue, epilogue and
trace restart.

ZeRO-3 fetches each module's parameters in the order it recorded (its trace), and raises when a module asks for
parameters the trace does not list. A fused loss reads the head's weight from inside the root's forward, which
makes it an external parameter of the root: before the first routed call the head is registered so with the
documented ``register_external_parameter``, and a trace recorded without it is dropped (ZeRO-3 records again),
so plain forwards and routed losses fetch the same parameters ever after.

``gather=``: under ZeRO-3 the named modules' partitioned parameters are gathered before the loss with
``deepspeed.zero.GatheredParameters`` (de-duplicated, as TRL does) and registered as external parameters of
``engine.module``, so its backward hooks gather them again for backward and their gradients are reduce-scattered
once. Without it the in-forward attribute getter gathers each weight lazily on first read: both are exact.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterable, Iterator
from typing import Any

from deepspeed import DeepSpeedEngine
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from torch import nn

from .._groups import group_ranks
from .._head import output_embedding
from ..errors import RouteValueError
from ._hooks import hooks_set_aside, put_hooks_back
from .routing import NOTHING, AroundLoss, Routing
from .topology import Averaging, Replica, Topology, replicated, sharded
from .whole import ReadWhole


def _stage(engine: DeepSpeedEngine) -> int:
    return int(engine.zero_optimization_stage())


class DeepSpeedAdapter(Routing, Topology, AroundLoss, ReadWhole):
    kind = "deepspeed"

    def claims(self, module: nn.Module) -> bool:
        return isinstance(module, DeepSpeedEngine)

    def peel(self, module: nn.Module) -> nn.Module:
        inner: nn.Module = module.module  # type: ignore[assignment]
        return inner

    def step_ranks(self, wrapper: nn.Module) -> tuple[int, ...] | None:
        # The engine's data-parallel group (the world minus model-parallel dimensions), not simply WORLD.
        return group_ranks(getattr(wrapper, "data_parallel_group", None))

    def replicas(self, wrapper: nn.Module) -> list[Replica]:
        # ZeRO 0-2 keep every parameter whole on each rank of the data-parallel group (not the world: model
        # parallelism through an mpu splits it); gradients live in the optimizer's partitions. An expert of a
        # DeepSpeed MoE layer (allreduce False) is reduced over its own expert-data-parallel group (group_name):
        # its copies are there. ZeRO-3 partitions.
        engine: DeepSpeedEngine = wrapper
        if _stage(engine) == 3:
            return sharded(engine.module)
        dense = group_ranks(getattr(engine, "data_parallel_group", None))
        experts = getattr(engine, "expert_data_parallel_group", None) or {}
        found = []
        for replica in replicated(engine.module, dense, grads=False):
            if getattr(replica.param, "allreduce", True) is False:
                copies = group_ranks(experts[replica.param.group_name])  # type: ignore[attr-defined]
                alone = "" if len(copies) > 1 else "expert group of one"
                replica = Replica(replica.name, replica.param, copies, False, alone)
            found.append(replica)
        return found

    def averaging(self, wrapper: nn.Module) -> Averaging:
        # Read from the engine as its reduction uses it (runtime/engine.py, zero/stage_1_and_2.py, zero/stage3.py):
        # gradients are summed over the sequence-data-parallel group (the data-parallel group when there is no
        # sequence parallelism) and divided by its size over the sequence-parallel size (the number of
        # data-parallel replicas) when averaging, always under ZeRO-3, unless gradient_allreduce_op is "sum"
        # under ZeRO 0-2. Pre- and post-divide factors only split that division. Each micro-batch's loss is
        # divided by gradient_accumulation_steps (engine.backward, or the engine's hooks on loss.backward()).
        engine: DeepSpeedEngine = wrapper
        group = getattr(engine, "seq_data_parallel_group", None) or getattr(engine, "data_parallel_group", None)
        ranks = group_ranks(group)
        replicas = len(ranks) / float(getattr(engine, "sequence_parallel_size", 1) or 1)
        averages = _stage(engine) == 3 or bool(getattr(engine, "gradient_average", True))
        return Averaging(ranks, group, replicas if averages else 1.0, float(engine.gradient_accumulation_steps()))

    def step_count(self, wrapper: nn.Module, optimizer: Any) -> int | None:
        outer = getattr(wrapper, "optimizer", None)  # the engine's (ZeRO's) optimizer, holding the torch one
        if optimizer is not outer and optimizer is not getattr(outer, "optimizer", None):
            return None
        return int(getattr(wrapper, "global_steps", 0))  # counted after the inner optimizer's steps

    def marks_forward(self, wrapper: nn.Module) -> bool:
        # Only ZeRO-3 leaves a trace of a running forward: its prologue flags every module's parameter dict.
        params = self.peel(wrapper)._parameters
        return bool(getattr(params, "_in_forward", False))

    def describe(self, wrapper: nn.Module) -> dict[str, Any]:
        engine: DeepSpeedEngine = wrapper
        return {
            "zero_stage": _stage(engine),
            "gradient_accumulation_steps": int(engine.gradient_accumulation_steps()),
        }

    def validate_gather(self, wrapper: nn.Module, gather: tuple[nn.Module, ...]) -> None:
        # route_loss has already checked containment; here: what ZeRO-3 can gather must be a partitioned param.
        inner = self.peel(wrapper)
        owned = {id(p) for p in inner.parameters()}
        for module in gather:
            if any(id(p) not in owned for p in module.parameters()):
                raise RouteValueError(
                    f"gather= entry {type(module).__name__} holds parameters that the DeepSpeed engine does not "
                    "own; pass submodules of the model given to deepspeed.initialize"
                )

    def recover(self, wrapper: nn.Module) -> None:
        # ZeRO-3: the failed forward skipped the engine's epilogue, so every module still says "in forward" (the
        # next step would be taken for a nested call) and the parameters it gathered stay whole. Run the
        # epilogue, then release every gathered parameter (partitioning is local: no collective), whether or not
        # the flag is still set: a fault inside the engine's own hooks can clear it and leave a parameter
        # gathered and held by a module that never finished. ZeRO 0-2 keep no forward state. The release is the
        # ZeRO-3 optimizer's own (what engine.empty_partition_cache() calls), without the engine's gc.collect()
        # and device cache emptying after it: a quarter of a second in a process holding a trainer, on every
        # batch a loop skips, for memory the next step gathers again.
        engine: DeepSpeedEngine = wrapper
        put_hooks_back(engine.module)
        if _stage(engine) != 3:
            return
        if self.marks_forward(engine):
            engine._forward_epilogue()
        release = getattr(engine.optimizer, "empty_partition_cache", None)
        if release is not None:
            release()

    def prepare(self, wrapper: nn.Module) -> None:
        engine: DeepSpeedEngine = wrapper
        if _stage(engine) == 3:
            _register_with_root(engine, _head_parameters(engine.module))

    def concurrency_error(self, wrapper: nn.Module, grad: bool, grad_calls: int) -> str | None:
        return "a DeepSpeed engine keeps one forward's state (ZeRO-3 gathers, timers, hooks) and is not thread-safe"

    @contextlib.contextmanager
    def read_whole(self, wrapper: nn.Module) -> Iterator[None]:
        # Submodules gather their own parameters when called; only a direct read (the head) needs a gather. A
        # forward of the whole model while the loss runs (a KL term computed with the reference model) would
        # release the head after calling it, as a normal forward does: the head is marked in use until the end.
        engine: DeepSpeedEngine = wrapper
        params = _partitioned(_head_parameters(engine.module) if _stage(engine) == 3 else ())
        if not params:
            yield
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            for param in params:
                param.ds_active_sub_modules.add(_READING)
            try:
                yield
            finally:  # before the gather's exit, which refuses to release a parameter still in use
                for param in params:
                    param.ds_active_sub_modules.discard(_READING)

    @contextlib.contextmanager
    def around_loss(self, wrapper: nn.Module, gather: tuple[nn.Module, ...]) -> Iterator[None]:
        engine: DeepSpeedEngine = wrapper
        with hooks_set_aside(engine.module), _gathered(engine, gather) if _stage(engine) == 3 else NOTHING:
            yield


def _head_parameters(model: nn.Module) -> Iterable[Any]:
    """The output embedding's parameters (none without one): what a fused loss reads inside the root's forward."""
    head = output_embedding(model)
    return head.parameters() if head is not None else ()


def _register_with_root(engine: DeepSpeedEngine, params: Iterable[Any]) -> None:
    """Register ``params`` as external parameters of ``engine.module`` (fetched and released with it). When that
    changes what the root fetches, a parameter-fetch trace recorded before is dropped: ZeRO-3 records anew."""
    import deepspeed

    root = engine.module
    known = getattr(root, "_external_params", {})
    own = {id(p) for p in root.parameters(recurse=False)}
    new = [p for p in params if id(p) not in known and id(p) not in own]
    if not new:
        return
    for param in new:
        deepspeed.zero.register_external_parameter(root, param)
    offload = getattr(engine.optimizer, "parameter_offload", None)
    for coordinator in _param_coordinators(offload) if offload is not None else ():
        if coordinator.is_complete_trace():
            coordinator._invalidate_trace()


def _param_coordinators(offload: Any) -> list[Any]:
    """ZeRO-3's parameter-fetch coordinators: one, or (where ``get_param_coordinator`` takes the module's
    ``training`` flag, as DeepSpeed's before 0.15.4 does) one per mode, each with its own trace."""
    get = offload.get_param_coordinator
    try:
        per_mode = bool(inspect.signature(get).parameters)
    except (TypeError, ValueError):  # no signature to read: ask as the installed release's own callers do
        per_mode = False
    return [get(training) for training in (True, False)] if per_mode else [get()]


# A submodule id no module has (DeepSpeed numbers them from 0): marks a head in use by read_whole.
_READING = -1


def _partitioned(params: Iterable[Any]) -> list[Any]:
    """The partitioned ones, once each. One already whole (persistent, or gathered by a running submodule) is
    left out: partitioning it at the end would pull it from under its owner."""
    seen: set[int] = set()
    found = []
    for param in params:
        if id(param) not in seen and getattr(param, "ds_status", None) == ZeroParamStatus.NOT_AVAILABLE:
            seen.add(id(param))
            found.append(param)
    return found


@contextlib.contextmanager
def _gathered(engine: DeepSpeedEngine, gather: tuple[nn.Module, ...]) -> Iterator[None]:
    params = _partitioned(param for module in gather for param in module.parameters())
    if not params:
        yield
        return
    import deepspeed

    _register_with_root(engine, params)  # as GatheredParameters(fwd_module=) would, the trace kept consistent
    # fwd_module: the root's backward hooks gather these again for backward and reduce-scatter their grads.
    with deepspeed.zero.GatheredParameters(params, fwd_module=engine.module):
        yield
