"""FSDP1 and FSDP2 on CPU gloo, with the layouts that matter: root-only, and ``lm_head`` (plus each block, for
FSDP2) as its own shard unit, which is the layout a plain root redirection gets wrong."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._torch_internals import fsdp1_flat_units, fsdp1_local_shard, fsdp2_api, replicate_with_fsdp
from .wrappers import Wrapped, gradient_sync_off, sgd_step


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def gather_flat(fsdp: nn.Module, local: Callable[[Any], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every original parameter's whole tensor of what ``local(flat_param)`` gives as this rank's shard of each
    unit's flat parameter (its gradient, its data): all-gathered and cut back into the original parameters (for
    use_orig_params True and False alike). A collective: every rank, same order."""
    found: dict[str, torch.Tensor] = {}
    for unit, flat, pieces in fsdp1_flat_units(fsdp):
        shard = local(flat)
        gathered = [torch.empty_like(shard) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, shard.detach().contiguous())
        full = torch.cat(gathered)
        prefix = ""
        for name, module in fsdp.named_modules():
            if module is unit:
                prefix = _clean(name) + "." if name else ""
        # The flat parameter interleaves alignment padding with the parameters (use_orig_params pads each to 16
        # bytes): walk its padded layout, not the bare numels.
        offset = 0
        for piece in pieces:
            if piece.name is not None:
                found[prefix + _clean(piece.name)] = full[offset : offset + piece.numel].view(piece.shape).clone()
            offset += piece.numel
    return found


def fsdp1_full_params(fsdp: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, read from each flat parameter's local shard (where a forward left the unit
    unsharded, too: ``summon_full_params`` refuses while a forward's state is pending)."""
    return gather_flat(fsdp, fsdp1_local_shard)


def build_fsdp1(model: nn.Module, opts: dict[str, Any]) -> Wrapped:
    """opts: ``use_orig_params`` (default True), ``lm_head_unit`` (wrap lm_head on its own, default False),
    ``hybrid`` (``HYBRID_SHARD`` over a (replicate, shard) mesh: 4 ranks or more, in pairs)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    use_orig_params = opts.get("use_orig_params", True)
    common: dict[str, Any] = {"device_id": torch.device("cpu"), "use_orig_params": use_orig_params}
    if opts.get("hybrid"):  # HYBRID_SHARD over a (replicate, shard) mesh of ranks in pairs
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import ShardingStrategy

        world = dist.get_world_size()
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
        common.update(sharding_strategy=ShardingStrategy.HYBRID_SHARD, device_mesh=mesh)
    if opts.get("lm_head_unit", False):
        model.register_module("lm_head", FSDP(model.get_submodule("lm_head"), **common))
    fsdp = FSDP(model, **common)

    def full_grads() -> dict[str, torch.Tensor]:
        return gather_flat(fsdp, lambda flat: flat.grad if flat.grad is not None else torch.zeros_like(flat))

    return Wrapped(fsdp, fsdp.module, fsdp.no_sync, full_grads, sgd_step(fsdp.parameters()))


def build_fsdp2(model: nn.Module, opts: dict[str, Any]) -> Wrapped:
    """opts: ``groups`` ("root": root only; "layers": each block and lm_head their own group; "layers_tied":
    blocks their own groups, embedding and tied lm_head one group; "tail": blocks their own groups but the last,
    which shares one group with lm_head, kept unsharded after forward, as accelerate's FSDP2 plugin builds the
    final norm and lm_head), ``reshard`` (``reshard_after_forward`` of the nested groups: True, False, or an
    int, resharding to that many ranks), ``hsdp`` (a 2-D mesh, replicate x shard, over ranks in pairs), ``mp``
    (a ``param_dtype`` name for ``MixedPrecisionPolicy``)."""
    from torch.distributed.device_mesh import init_device_mesh

    _, MixedPrecisionPolicy, fully_shard, DTensor = fsdp2_api()

    world = dist.get_world_size()
    if opts.get("hsdp"):
        if world < 4 or world % 2:
            raise ValueError(f"HSDP needs an even number of ranks, at least 4 (got {world})")
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if opts.get("mp"):
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, opts["mp"]))
    groups = opts.get("groups", "root")
    nested = {**kwargs, "reshard_after_forward": opts.get("reshard", True)}
    if groups in ("layers", "layers_tied", "tail"):
        blocks = list(model.get_submodule("blocks").children())
        head = model.get_submodule("lm_head")
        for block in blocks[:-1] if groups == "tail" else blocks:
            fully_shard(block, **nested)
        if groups == "layers_tied":  # a tied embedding and head must share one group
            fully_shard([model.get_submodule("embed"), head], **nested)
        elif groups == "tail":
            fully_shard([blocks[-1], head], **{**kwargs, "reshard_after_forward": False})
        else:
            fully_shard(head, **nested)
    # The root keeps its parameters unsharded after forward by default, which hides the bug for losses that
    # call the root itself; resharding it (a legitimate memory setting) makes an unrouted read fail.
    fully_shard(model, reshard_after_forward=opts.get("reshard_root", True), **kwargs)
    root: Any = model  # an FSDPModule now

    def full_grads() -> dict[str, torch.Tensor]:
        return {
            name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else torch.zeros(p.shape)).detach().clone()
            for name, p in model.named_parameters()
        }

    no_sync = functools.partial(gradient_sync_off, root)
    return Wrapped(model, model, no_sync, full_grads, sgd_step(model.parameters()))


def build_replicate_fsdp(model: nn.Module, opts: dict[str, Any]) -> Wrapped:
    """``replicate`` built on FSDP2 (torch >= 2.10). opts: ``lm_head_group`` (lm_head replicated as its own group,
    default False)."""
    replicate = replicate_with_fsdp()

    if opts.get("lm_head_group", False):
        replicate(model.get_submodule("lm_head"))
    replicate(model)
    root: Any = model

    def full_grads() -> dict[str, torch.Tensor]:
        grads: dict[str, torch.Tensor] = {}
        for name, p in model.named_parameters():
            grad = p.grad if p.grad is not None else torch.zeros(p.shape)
            grads[name] = (grad.to_local() if hasattr(grad, "to_local") else grad).detach().clone()
        return grads

    no_sync = functools.partial(gradient_sync_off, root)
    return Wrapped(model, model, no_sync, full_grads, sgd_step(model.parameters()))


def build_fsdp2_cp(model: nn.Module, opts: dict[str, Any]) -> Wrapped:
    """opts: ``cp``. Context parallelism by hand: ranks in (dp, cp) order, each sequence cut into ``cp`` parts
    (rank ``r`` reads part ``r % cp`` of replica ``r // cp``'s batch), every block and the root ``fully_shard``
    over one mesh of every rank: the flattened dp x cp mesh, as torchtitan shards with context parallelism. The
    tiny model has no attention (each position's hidden state is its own token's), so a cut sequence needs no
    ring attention and its parts' losses add up to the whole's: what is checked is how tokens are counted."""
    from torch.distributed.device_mesh import DeviceMesh

    fully_shard = fsdp2_api().fully_shard
    world, cp = dist.get_world_size(), int(opts["cp"])
    if cp < 2 or world % cp or world == cp:
        raise ValueError(f"context parallelism over {cp} ranks needs at least 2, dividing the world with dp >= 2")
    flat = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("dp_cp",))
    blocks: Any = model.get_submodule("blocks")
    for block in blocks:
        fully_shard(block, mesh=flat)
    fully_shard(model, mesh=flat)
    root: Any = model

    def full_grads() -> dict[str, torch.Tensor]:
        grads: dict[str, torch.Tensor] = {}
        for name, param in model.named_parameters():
            grad: Any = param.grad
            grads[name] = grad.full_tensor().detach().clone() if grad is not None else torch.zeros(param.shape)
        return grads

    rank = dist.get_rank()
    no_sync = functools.partial(gradient_sync_off, root)
    return Wrapped(model, model, no_sync, full_grads, sgd_step(model.parameters()), data_rank=rank // cp,
                   data_world=world // cp, seq_shard=(rank % cp, cp))  # fmt: skip
