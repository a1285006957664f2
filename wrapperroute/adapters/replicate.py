"""torch's composable ``replicate()`` (``torch.distributed._composable.replicate``): DDP with no wrapper object.

``replicate(module)`` gives the module a new class (``DDP<Cls>``, a subclass of the composable ``DDP``) and two
forward hooks: the pre-hook builds a ``DistributedDataParallel`` over the module's parameters on the first call
(lazily) and runs its ``_pre_forward`` (which arms the reducer, unless ``set_requires_gradient_sync(False)``);
the post-hook runs its ``_post_forward`` on the output. As with FSDP2, the module *is* the wrapper: we swap its
own forward and call it, so both hooks run around the loss.

While the loss runs, the module's hooks are set aside (``_hooks.py``): a loss that calls the model again gets
a plain forward, not a second ``_pre_forward``/``_post_forward`` that would arm the reducer twice in one step.
The pre-hook also sets ``DistributedDataParallel._active_ddp_module``, so the functorch fallback applies here as
under DDP (see ``ddp.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed._composable.replicate import DDP as ComposableDDP
from torch.distributed._composable.replicate import replicate
from torch.nn.parallel import DistributedDataParallel

from .._groups import group_ranks
from ._hooks import hooks_set_aside, put_hooks_back
from .ddp import check_loss_reachable, concurrency_reason, mean_over, without_graph_optimizer
from .routing import AroundLoss, Isolating, Routing
from .topology import ArmsInForward, Averaging, Replica, Topology, replicated


def _ddp_of(module: nn.Module) -> DistributedDataParallel | None:
    """The DistributedDataParallel the pre-hook built, or None before the module's first forward."""
    state = replicate.state(module)
    return getattr(state, "_ddp", None) if state is not None else None


def _given(module: nn.Module) -> dict[str, Any]:
    """The arguments ``replicate()`` recorded for the DDP its first forward builds."""
    state = replicate.state(module)
    return dict(state._init_kwargs) if state is not None else {}


def _option(module: nn.Module, name: str, default: Any) -> Any:
    """A DDP option: read from the built DDP, else from the arguments ``replicate()`` recorded for it."""
    ddp = _ddp_of(module)
    if ddp is not None:
        return getattr(ddp, name)
    return _given(module).get(name, default)


class ReplicateAdapter(Routing, Topology, AroundLoss, Isolating, ArmsInForward):
    kind = "replicate"

    def claims(self, module: nn.Module) -> bool:
        return isinstance(module, ComposableDDP)

    def peel(self, module: nn.Module) -> nn.Module:
        return module

    def marks_forward(self, wrapper: nn.Module) -> bool:
        active = DistributedDataParallel._active_ddp_module  # set by the pre-hook, cleared by the post-hook
        return active is not None and active is _ddp_of(wrapper)

    def describe(self, wrapper: nn.Module) -> dict[str, Any]:
        return {
            "find_unused_parameters": _option(wrapper, "find_unused_parameters", False),
            "static_graph": _option(wrapper, "static_graph", False),
            "gradient_as_bucket_view": _option(wrapper, "gradient_as_bucket_view", False),
        }

    def around_loss(self, wrapper: nn.Module, gather: tuple[nn.Module, ...]) -> contextlib.AbstractContextManager[Any]:
        return hooks_set_aside(wrapper)

    def isolated(self, wrapper: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return without_graph_optimizer()

    def result_check(self, wrapper: nn.Module) -> Callable[[nn.Module, Any], None] | None:
        return _check_reachable if _option(wrapper, "find_unused_parameters", False) else None

    def recover(self, wrapper: nn.Module) -> None:
        put_hooks_back(wrapper)
        # The pre-hook set the marker and the post-hook, which clears it, never ran: left set, Dynamo would
        # apply DDP's graph optimizer to everything compiled from now on.
        ddp = _ddp_of(wrapper)
        if ddp is not None and DistributedDataParallel._active_ddp_module is ddp:
            DistributedDataParallel._active_ddp_module = None

    def concurrency_error(self, wrapper: nn.Module, grad: bool, grad_calls: int) -> str | None:
        ddp = _ddp_of(wrapper)
        if ddp is None:
            return "replicate() builds its DDP state in the first forward, which two threads would race to do"
        return concurrency_reason(ddp, grad, grad_calls)

    def step_ranks(self, wrapper: nn.Module) -> tuple[int, ...] | None:
        return group_ranks(_process_group(wrapper))

    def syncs_gradients(self, wrapper: nn.Module) -> bool:
        return requires_gradient_sync(wrapper)

    def inner_wrappers(self, wrapper: nn.Module) -> tuple[nn.Module, ...]:
        ddp = _ddp_of(wrapper)
        return (ddp,) if ddp is not None else ()

    def meshes(self, wrapper: nn.Module) -> tuple[Any, ...]:
        mesh = _given(wrapper).get("device_mesh")
        return (mesh,) if mesh is not None else ()

    def replicas(self, wrapper: nn.Module) -> list[Replica]:
        return replicated(wrapper, group_ranks(_process_group(wrapper)))

    def averaging(self, wrapper: nn.Module) -> Averaging:
        group = _process_group(wrapper)
        ddp = _ddp_of(wrapper)
        if ddp is None:  # before the first forward: the DDP it builds averages over this group
            ranks = group_ranks(group)
            return Averaging(ranks, group, float(len(ranks)))
        return mean_over(ddp, group)


def _process_group(module: nn.Module) -> Any:
    """The group its DDP all-reduces over: the built DDP's, else what ``replicate()`` was given (a process group,
    or a device mesh: one dimension of a larger mesh), else None (the default group)."""
    ddp = _ddp_of(module)
    if ddp is not None:
        return ddp.process_group
    given = _given(module)
    group, mesh = given.get("process_group"), given.get("device_mesh")
    return group if group is not None or mesh is None else mesh.get_group()


def requires_gradient_sync(module: nn.Module) -> bool:
    """False while ``module.set_requires_gradient_sync(False)`` holds (composable replicate's ``no_sync``)."""
    state = replicate.state(module)
    return not (state is not None and state._no_sync)


def _check_reachable(wrapper: nn.Module, result: Any) -> None:
    ddp = _ddp_of(wrapper)
    if ddp is not None:  # always built by now: the pre-hook ran before the loss
        check_loss_reachable(ddp, result)
