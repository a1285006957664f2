"""FullyShardedDataParallel (FSDP1).

The root's forward unshards the root unit's flat parameter and its post-backward hooks reduce-scatter.
Units nested inside (``lm_head`` wrapped on its own) are only unsharded in their own forward, so loss reads of
their weights are routed through them as well (see ``_units.py``).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch.distributed as dist
from torch import nn

from .._groups import group_ranks
from ._units import UnitFamily
from .routing import NOTHING, Routing, ShardUnits
from .topology import Averaging, Replica, Topology, replicated, sharded
from .whole import ReadWhole

_UNITS = UnitFamily("torch.distributed.fsdp.fully_sharded_data_parallel:FullyShardedDataParallel")
_is_unit = _UNITS.has


class FSDP1Adapter(Routing, Topology, ShardUnits, ReadWhole):
    kind = "fsdp1"

    def claims(self, module: nn.Module) -> bool:
        return _is_unit(module)

    def peel(self, module: nn.Module) -> nn.Module:
        inner: nn.Module = module.module  # type: ignore[assignment]
        return inner

    def redirect_target(self, wrapper: nn.Module) -> nn.Module:
        target: nn.Module = wrapper._fsdp_wrapped_module  # type: ignore[assignment]
        return target

    def marks_forward(self, wrapper: nn.Module) -> bool:
        handle = getattr(wrapper, "_handle", None)
        if handle is None:  # a root without parameters of its own: only its state, set in forward and in backward
            return getattr(getattr(wrapper, "training_state", None), "name", None) == "FORWARD_BACKWARD"
        return getattr(handle, "_training_state", None) is not None and handle._training_state.name == "FORWARD"

    def describe(self, wrapper: nn.Module) -> dict[str, Any]:
        return {
            "use_orig_params": getattr(wrapper, "_use_orig_params", None),
            "nested_units": sum(1 for m in wrapper.modules() if _is_unit(m)) - 1,
        }

    def recover(self, wrapper: nn.Module) -> None:
        # What FSDP's post-backward final callback does between steps, minus gradient finalisation: reshard
        # every unit and mark it idle. Without this the root stays in FORWARD and the next step would be taken
        # for a call from inside the forward. Always free the unsharded buffer: a unit that kept it (the root
        # after a completed forward) would skip its next all-gather while a rank that freed it would not.
        from torch.distributed.fsdp._common_utils import HandleTrainingState, TrainingState
        from torch.distributed.fsdp._runtime_utils import _reshard

        for state in getattr(wrapper, "_all_fsdp_states", None) or [wrapper]:
            handle = getattr(state, "_handle", None)
            if handle is not None:
                # NO_SHARD has nothing to free, but its parameters must go back to being the module's
                # attributes (torch 2.4 leaves plain-tensor views there after a forward that raised).
                _reshard(state, handle, handle.uses_sharded_strategy)
                handle._training_state = HandleTrainingState.IDLE
                handle._prefetched = False
                handle._needs_pre_backward_unshard = False
                handle._post_forward_index = None
            state.training_state = TrainingState.IDLE

    def step_ranks(self, wrapper: nn.Module) -> tuple[int, ...] | None:
        return group_ranks(wrapper.process_group)

    def replicas(self, wrapper: nn.Module) -> list[Replica]:
        # NO_SHARD keeps every parameter whole on each rank of its group, as DDP; the other strategies shard.
        if str(getattr(wrapper, "sharding_strategy", "")).endswith("NO_SHARD"):
            return replicated(self.peel(wrapper), group_ranks(wrapper.process_group))
        return sharded(self.peel(wrapper))

    def averaging(self, wrapper: nn.Module) -> Averaging | None:
        # FSDP divides by its pre- and post-divide factors, which together make its data-parallel world size:
        # the shard group's, times the replicating group's under hybrid sharding.
        fsdp: Any = wrapper
        divides_by = float(fsdp._gradient_predivide_factor * fsdp._gradient_postdivide_factor)
        hook = getattr(wrapper, "_comm_hook", None)
        unread = ""
        if hook is not None and not getattr(hook, "__module__", "").startswith("torch."):
            unread = (
                f"FSDP communication hook {getattr(hook, '__qualname__', repr(hook))} (not one of torch's) may "
                f"scale the gradients as it likes; taken to divide by {divides_by:g}, as FSDP's own reduction"
            )
        inter = getattr(fsdp, "_inter_node_pg", None) if "HYBRID" in str(fsdp.sharding_strategy) else None
        if inter is None:
            return Averaging(group_ranks(fsdp.process_group), fsdp.process_group, divides_by, unread=unread)
        mesh = getattr(fsdp, "_device_mesh", None)
        if mesh is not None:
            ranks = tuple(sorted(mesh.mesh.flatten().tolist()))
        elif fsdp.process_group.size() * inter.size() == dist.get_world_size():
            ranks = tuple(range(dist.get_world_size()))
        else:  # two groups given by hand over part of the world: which ranks they span is not written anywhere
            return None
        return Averaging(ranks, None, divides_by, unread=unread)

    def read_whole(self, wrapper: nn.Module) -> contextlib.AbstractContextManager[Any]:
        # Not built: FSDP1 forbids a forward inside summon_full_params, and a reference model's forward can
        # run while its weights are read (a KL term). Said, not passed over.
        warnings.warn(
            f"wrapperroute: a frozen FSDP1 model ({type(self.peel(wrapper)).__name__}) read outside its forward "
            "(a reference or teacher model) is left as it is: its root unit's parameters stay sharded there. "
            "Holding them whole is built and measured for FSDP2 (fully_shard) and DeepSpeed ZeRO-3.",
            RuntimeWarning,
            stacklevel=3,
        )
        return NOTHING

    def nested_units(self, wrapper: nn.Module, gather: tuple[nn.Module, ...]) -> tuple[nn.Module, ...]:
        return _UNITS.to_enter(wrapper, self.peel(wrapper), gather)
