"""``fully_shard`` (FSDP2): no wrapper object. The module's class becomes ``FSDP<Cls>`` and FSDP's logic runs
in forward hooks, so the root *is* the model: we swap the root's own forward and call it.

Two consequences handled here:
- a loss that calls the root model again (natural: with FSDP2, the "unwrapped" model is the root) would run
  FSDP's hooks a second time and reshard mid-loss; while the loss runs the unit's hooks are set aside, so such
  a call is a plain forward over parameters that are already unsharded;
- groups nested below the root (``fully_shard(lm_head)``) unshard only in their own forward: loss reads of
  their weights are routed through them too (see ``_units.py``).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._groups import dtensor_copies
from .._torch_internals import FSDP2_HOMES
from ._hooks import hooks_set_aside, other_hooks_set_aside, put_hooks_back
from ._units import UnitFamily
from .routing import AroundLoss, Routing, ShardUnits
from .topology import Assigned, Averaging, Replica, Topology
from .whole import ReadWhole

# FSDPModule, and replicate() built on FSDP2 (torch >= 2.10; a ReplicateModule is an FSDPModule)
_UNITS = UnitFamily(*(f"{home}:FSDPModule" for home in FSDP2_HOMES))
_is_unit = _UNITS.has
_REPLICATES = UnitFamily("torch.distributed._composable.replicate_with_fsdp:ReplicateModule")


class FSDP2Adapter(Routing, Topology, AroundLoss, ShardUnits, ReadWhole):
    kind = "fsdp2"

    def claims(self, module: nn.Module) -> bool:
        return _is_unit(module) and not _REPLICATES.has(module)

    def peel(self, module: nn.Module) -> nn.Module:
        return module

    def marks_forward(self, wrapper: nn.Module) -> bool:
        state = wrapper._get_fsdp_state()  # type: ignore[operator]
        return getattr(state, "_training_state", None) is not None and state._training_state.name == "FORWARD"

    def describe(self, wrapper: nn.Module) -> dict[str, Any]:
        return {"nested_groups": sum(1 for m in wrapper.modules() if _is_unit(m)) - 1}

    def recover(self, wrapper: nn.Module) -> None:
        for unit in wrapper.modules():  # the root, or a nested group whose forward the loss was routed through
            put_hooks_back(unit)
        # FSDP2's documented recovery after a forward that raised (torch >= 2.13): reshard every group and
        # clear the iteration's trackers; otherwise the root stays in FORWARD with iter_forward_root set.
        state = wrapper._get_fsdp_state()  # type: ignore[operator]
        reset = getattr(wrapper, "reset_iter_state", None)
        if reset is not None:
            with _gradients_kept(state):
                reset()
            return
        ctx = state._state_ctx
        for each in ctx.all_states:  # older torch: the same by hand, without collectives
            for group in _param_groups(each):
                group._training_state = type(group._training_state).IDLE
                group._post_forward_indices.clear()
                group.reshard()
            each._training_state = type(each._training_state).IDLE
        # The backward prefetches groups in the recorded post-forward order, cleared only by a completed
        # backward: a rank whose failed forward recorded a different order would prefetch other groups than
        # its peers in the next backward and deadlock (torch 2.9.1, one rank failing under agree=True).
        state._comm_ctx.post_forward_order.clear()
        ctx.iter_forward_root = None
        ctx.post_backward_final_callback_queued = False

    def nested_units(self, wrapper: nn.Module, gather: tuple[nn.Module, ...]) -> tuple[nn.Module, ...]:
        return _UNITS.to_enter(wrapper, wrapper, gather)

    def meshes(self, wrapper: nn.Module) -> tuple[Any, ...]:
        return _meshes(wrapper)

    def step_ranks(self, wrapper: nn.Module) -> tuple[int, ...] | None:
        # Every rank of the groups' mesh runs the step: HSDP's replicate x shard ranks, or a sub-mesh of the
        # world (TP + FSDP2, models on disjoint ranks), never simply WORLD. Read from FSDP's state, not the
        # parameters: a root that keeps them unsharded after its forward holds plain tensors then.
        state = wrapper._get_fsdp_state()  # type: ignore[operator]
        for each in state._state_ctx.all_states:
            for group in _param_groups(each):
                return tuple(sorted(group.mesh_info.mesh.mesh.flatten().tolist()))
        return None

    def around_loss(self, wrapper: nn.Module, gather: tuple[nn.Module, ...]) -> contextlib.AbstractContextManager[Any]:
        return hooks_set_aside(wrapper)

    def averaging(self, wrapper: nn.Module) -> Averaging | None:
        # Each parameter group reduces over its data-parallel mesh (HSDP: reduce-scatter over one dimension,
        # all-reduce over the other) and divides by its gradient divide factor, the mesh's size unless
        # set_gradient_divide_factor set another. A (dp, tp) or flattened (dp x cp) model: the mesh given to
        # fully_shard, so tensor-parallel ranks are not in it and context-parallel ones are.
        found: set[tuple[tuple[int, ...], float, str]] = set()
        meshes = {}
        for unit in wrapper.modules():
            if _is_unit(unit):
                for group in _param_groups(unit._get_fsdp_state()):  # type: ignore[operator]
                    mesh = group.mesh_info.mesh
                    ranks = tuple(sorted(mesh.mesh.flatten().tolist()))
                    divides_by, unread = _divide_factor(group, len(ranks))
                    found.add((ranks, divides_by, unread))
                    meshes[ranks] = mesh
        if not found or len({factor for _, factor, _ in found}) != 1:
            return None  # no group (nothing to reduce), or groups dividing by different factors
        # Groups over nested meshes (torchtitan's experts, sharded over the ranks of one expert-parallel group,
        # dividing by the dense layers' factor): every rank's tokens reach the dense layers, so the widest mesh's
        # ranks are the ones that train on different data.
        ranks, divides_by, unread = max(found, key=lambda entry: len(entry[0]))
        if not all(set(other) <= set(ranks) for other, _, _ in found):
            return None  # meshes over different ranks, neither holding the other
        unread = "; ".join(sorted({said for _, _, said in found if said}))
        mesh = meshes[ranks]
        return Averaging(ranks, mesh.get_group() if mesh.ndim == 1 else None, divides_by, unread=unread)

    def replicas(self, wrapper: nn.Module) -> list[Replica]:
        # A DTensor's local part is copied on the ranks of its mesh that share this rank's coordinates on the
        # dimensions it is sharded over: HSDP's replicate dimension, replicate()'s whole mesh, a tensor-parallel
        # model's replicated parameters; none for FSDP's shards or an expert's. A plain parameter (an adapter
        # added after fully_shard) is whole on every rank the model lives on: equal there, or a desync.
        everywhere = _mesh_ranks(wrapper)
        managed = _sharded_forms(wrapper)
        found = []
        for name, param in wrapper.named_parameters():
            if not param.requires_grad:
                continue
            # a parameter FSDP manages is compared in its sharded form, even while a forward (one that raised,
            # one resharding not after it) leaves the module holding its unsharded form
            param = managed.get(id(param), param)
            copies = dtensor_copies(param)
            if copies is None:  # a plain tensor, whole on each rank
                found.append(Replica(name, param, everywhere))
            else:
                found.append(Replica(name, param, copies, alone="" if len(copies) > 1 else "sharded"))
        return found

    reduction = "FSDP2's reduce-scatter"

    def assigned_gradients(self, wrapper: nn.Module) -> Assigned | None:
        # FSDP2 writes each managed parameter's sharded gradient after its reduce-scatter (all-reduce for
        # replicate); the sharded DTensor is in no autograd graph of a forward inside its unit.
        managed = _sharded_forms(wrapper)
        named = []
        for name, param in wrapper.named_parameters():
            sharded = managed.get(id(param))
            if sharded is not None and sharded.requires_grad:
                named.append((name, sharded))
        return Assigned(self.reduction, named) if named else None

    @contextlib.contextmanager
    def read_whole(self, wrapper: nn.Module) -> Iterator[None]:
        # The root's group and the output embedding's unit: a backbone called as a submodule unshards its
        # layers' groups itself, but reads the root's parameters (the token embedding) as they are. A forward
        # of the whole model while the loss runs (a KL term computed with the reference model) would reshard
        # them after it, as a normal forward does: until the end they are held with resharding after forward
        # off (what set_reshard_after_forward(False) sets), then put back as they were and resharded.
        wrapper._get_fsdp_state()._lazy_init()  # type: ignore[operator]  # as its forward would: root first
        units = (wrapper, *self.nested_units(wrapper, ()))
        groups = [group for unit in units for group in _param_groups(unit._get_fsdp_state())]  # type: ignore[operator]
        saved = [group.post_forward_mesh_info for group in groups]
        for unit in units:
            unit.unshard()  # type: ignore[operator]
        for group in groups:
            group.post_forward_mesh_info = None
        try:
            yield
        finally:
            for group, info in zip(groups, saved, strict=True):
                group.post_forward_mesh_info = info
            for unit in units:
                unit.reshard()  # type: ignore[operator]


def own_hooks_only(unit: nn.Module) -> contextlib.AbstractContextManager[None]:
    """The FSDP2 unit's forward hooks other than FSDP2's own set aside for the block (``other_hooks_set_aside``):
    entered with wrapperroute's call as its input, the unit must run FSDP2's pre- and post-forward and nothing
    else. FSDP2's are known by the handles its state keeps (a group unit's holds one per module); where it keeps
    none, nothing is set aside."""
    state = unit._get_fsdp_state()  # type: ignore[operator]
    own: set[int] = set()
    for handle in (getattr(state, "_pre_forward_hook_handle", None), getattr(state, "_post_forward_hook_handle", None)):
        for each in getattr(handle, "handles", None) or ((handle,) if handle is not None else ()):
            own.add(each.id)
    return other_hooks_set_aside(unit, own)


_sharded_params: dict[int, bool] = {}  # id(tensor) -> whether it is a sharded parameter some FSDP2 unit manages


def is_sharded_param(tensor: Any) -> bool:
    """Whether ``tensor`` is a sharded parameter an FSDP2 unit manages: the ``DTensor`` its module holds between
    forwards and the optimizer steps, never what a loss inside the unit's forward reads (that is the unsharded
    parameter the forward gathered). Found by one scan of the live FSDP2 units per tensor, remembered while the
    tensor lives: a tensor-parallel ``DTensor`` head pays that scan once."""
    key = id(tensor)
    known = _sharded_params.get(key)
    if known is None:
        unit_class = _UNITS.loaded()
        if unit_class is None:
            return False  # no FSDP2 unit can exist yet
        known = any(
            managed.sharded_param is tensor
            for unit in gc.get_objects()
            if issubclass(type(unit), unit_class)  # type(), not isinstance: proxies warn when asked their class
            for group in _param_groups(unit._get_fsdp_state())
            for managed in group.fsdp_params
        )
        _sharded_params[key] = known
        weakref.finalize(tensor, _sharded_params.pop, key, None)
    return known


def on_fully_shard(callback: Callable[[list[nn.Module]], None]) -> Callable[[], None]:
    """From now on, after every ``fully_shard(...)`` a script calls through the names it imports it by
    (``torch.distributed.fsdp``, and ``torch.distributed._composable.fsdp`` where that is the same function), call
    ``callback`` with the modules it made a unit of (read their parameters with :func:`managed_params`). Returns
    the undo."""
    import torch.distributed.fsdp as public

    homes = [public]
    try:
        import torch.distributed._composable.fsdp as composable

        homes.append(composable)
    except ImportError:
        pass
    original = public.fully_shard

    @functools.wraps(original)
    def made(module: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(module, *args, **kwargs)
        callback(list(result) if isinstance(result, list | tuple) else [result])
        return result

    changed = [home for home in homes if getattr(home, "fully_shard", None) is original]
    for home in changed:
        home.fully_shard = made  # type: ignore[attr-defined]

    def undo() -> None:
        for home in changed:
            if home.fully_shard is made:
                home.fully_shard = original  # type: ignore[attr-defined]

    return undo


def managed_params(units: list[nn.Module]) -> list[torch.Tensor]:
    """The sharded parameters FSDP2 manages in ``units`` (modules ``fully_shard`` made units of)."""
    return [managed.sharded_param
            for unit in units if _is_unit(unit)
            for group in _param_groups(unit._get_fsdp_state())  # type: ignore[operator]
            for managed in group.fsdp_params]  # fmt: skip


@contextlib.contextmanager
def _gradients_kept(state: Any) -> Iterator[None]:
    """The gradient state earlier, completed backwards left, as it was after the block: each sharded gradient,
    each unsharded leaf's gradient accumulated under ``set_requires_gradient_sync(False)``, each group's HSDP
    partial reduction under ``set_requires_all_reduce(False)``. ``reset_iter_state`` treats the failed
    iteration's micro-batches as lost and drops them (torch 2.13 the partial reduction, 2.15 every gradient
    too: a routed step after a skipped batch was 0.018 off): a forward that raised before any backward of its
    own has added nothing to them, and the batch a loop skips must leave the step's other micro-batches as
    they were."""
    grads: list[tuple[torch.Tensor, torch.Tensor]] = []
    partials: list[tuple[Any, Any]] = []
    for each in state._state_ctx.all_states:
        for group in _param_groups(each):
            partials.append((group, getattr(group, "_partial_reduce_output", None)))
            for managed in group.fsdp_params:
                for param in (managed.sharded_param, getattr(managed, "_unsharded_param", None)):
                    if param is not None and param.grad is not None:
                        grads.append((param, param.grad))
    yield
    for param, grad in grads:
        param.grad = grad
    for group, partial in partials:
        if partial is not None:
            group._partial_reduce_output = partial


def _param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups: a list since torch 2.6, one optional group before."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def _divide_factor(group: Any, mesh_size: int) -> tuple[float, str]:
    """What a parameter group divides its reduced gradients by, and what of it cannot be read."""
    unread = ""
    if getattr(group, "_all_reduce_hook", None) is not None:
        unread = "an FSDP2 all-reduce hook (set_all_reduce_hook) may scale the gradients as it likes"
    factor = getattr(group, "gradient_divide_factor", None)
    if factor is not None:
        return float(factor), unread
    if getattr(group, "reduce_scatter_reduce_op", None) is not None:  # torch before set_gradient_divide_factor
        unread = "a reduce-scatter op set by hand (set_reduce_scatter_divide_factor) cannot be read back"
    return float(mesh_size), unread


def _meshes(wrapper: nn.Module) -> tuple[Any, ...]:
    """The meshes of every unit's parameter groups, known from ``fully_shard`` on (no forward needed)."""
    found: list[Any] = []
    for unit in wrapper.modules():
        if _is_unit(unit):
            for group in _param_groups(unit._get_fsdp_state()):  # type: ignore[operator]
                if all(mesh is not group.mesh_info.mesh for mesh in found):
                    found.append(group.mesh_info.mesh)
    return tuple(found)


def _sharded_forms(wrapper: nn.Module) -> dict[int, Any]:
    """Each parameter FSDP manages, by the ``id`` of either of its forms (sharded, or unsharded while a forward
    holds it so): its sharded form, the ``DTensor`` the optimizer steps."""
    forms: dict[int, Any] = {}
    for unit in wrapper.modules():
        if _is_unit(unit):
            for group in _param_groups(unit._get_fsdp_state()):  # type: ignore[operator]
                for managed in group.fsdp_params:
                    forms[id(managed.sharded_param)] = managed.sharded_param
                    unsharded = getattr(managed, "_unsharded_param", None)
                    if unsharded is not None:
                        forms[id(unsharded)] = managed.sharded_param
    return forms


def _mesh_ranks(wrapper: nn.Module) -> tuple[int, ...]:
    """Every rank the model lives on: its FSDP groups' meshes and its parameters' (a tensor-parallel mesh)."""
    ranks: set[int] = set()
    for mesh in _meshes(wrapper):
        ranks.update(mesh.mesh.flatten().tolist())
    for param in wrapper.parameters():
        mesh = getattr(param, "device_mesh", None)
        if mesh is not None:
            ranks.update(mesh.mesh.flatten().tolist())
    return tuple(sorted(ranks)) or (dist.get_rank(),)


class ReplicateFSDPAdapter(FSDP2Adapter):
    """``torch.distributed._composable.replicate_with_fsdp.replicate``: FSDP2's machinery over a replicate-only
    mesh. Parameters are ``DTensor(Replicate())``, gradients all-reduced in FSDP2's post-backward; routed exactly
    as FSDP2 (nested ``replicate`` groups included), but named apart: it replicates, it does not shard."""

    kind = "replicate_fsdp"
    reduction = "replicate's all-reduce"

    def claims(self, module: nn.Module) -> bool:
        return _REPLICATES.has(module)
