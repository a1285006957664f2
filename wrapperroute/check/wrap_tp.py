"""Tensor-parallel layouts on CPU ranks: a (dp, tp) mesh built by hand, and transformers' own
(``from_pretrained(..., distributed_config=DistributedConfig(tp_size=..., fsdp_size=...))``). The head is sharded
on the vocabulary over ``tp``; FSDP2 shards over ``dp`` when there is more than one data-parallel replica.
Ranks of one tensor-parallel group read the same batch (``Wrapped.data_rank``)."""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .models import TinyCausalLM
from .wrappers import Wrapped, sgd_step


def _mesh(tp: int, hsdp: bool = False) -> Any:
    """(dp, tp), or with ``hsdp`` (replicate, shard, tp) with one shard rank: FSDP2's HSDP beside the tensor
    parallelism (on 4 ranks, 2 replicas of a model split over 2 ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if tp < 2 or world % tp:
        raise ValueError(f"tensor parallelism over {tp} ranks needs at least 2, dividing the world (got {world})")
    if hsdp:
        return init_device_mesh("cpu", (world // tp, 1, tp), mesh_dim_names=("replicate", "shard", "tp"))
    return init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient whole (a collective for the DTensor ones: every rank, same order)."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros(param.shape)
        full = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        grads[name] = full.detach().clone()
    return grads


def _wrapped(model: nn.Module, data_rank: int, data_world: int, twin: nn.Module | None = None) -> Wrapped:
    import contextlib

    from .wrap_fsdp import gradient_sync_off

    no_sync: Any = (lambda: gradient_sync_off(model)) if data_world > 1 else contextlib.nullcontext
    return Wrapped(model, model, no_sync, lambda: _full_grads(model), sgd_step(model.parameters()),
                   data_rank=data_rank, data_world=data_world, twin=twin)  # fmt: skip


def build_tp(model: nn.Module, opts: dict[str, Any]) -> Wrapped:
    """opts: ``tp``, ``hsdp``. The head ``ColwiseParallel`` over ``tp`` (its weight sharded on the vocabulary;
    its output left sharded: a fused loss never calls it), the rest replicated over ``tp``; every block and the root
    ``fully_shard`` over ``dp`` (the root resharding after its forward) when it has more than one rank; with
    ``hsdp``, over (replicate, shard): a 3-D mesh."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from .._torch_internals import fsdp2_api

    hsdp = bool(opts.get("hsdp"))
    mesh = _mesh(int(opts["tp"]), hsdp)
    parallelize_module(model, mesh["tp"], {"lm_head": ColwiseParallel(use_local_output=False)})
    data = mesh["replicate", "shard"] if hsdp else mesh["dp"]
    if data.size() > 1:
        fully_shard = fsdp2_api().fully_shard
        blocks: Any = model.get_submodule("blocks")
        for block in blocks:
            fully_shard(block, mesh=data)
        # resharding the root after its forward (a memory setting) is what makes a read outside it fail, as in
        # the FSDP2 layouts of wrap_fsdp.py; kept unsharded, a loss that calls the root hides the bug
        fully_shard(model, mesh=data, reshard_after_forward=True)
    replica = mesh.get_local_rank("replicate") if hsdp else mesh.get_local_rank("dp")
    return _wrapped(model, replica, data.size())


def _tiny_llama(config: Any) -> str:
    """A tiny Llama with the check model's vocabulary and width, saved once per machine (rank 0 writes, the
    others wait): transformers loads a distributed model from a folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = {"vocab_size": config.vocab, "hidden_size": config.hidden, "intermediate_size": 2 * config.hidden,
                "num_hidden_layers": config.layers, "num_attention_heads": 4, "num_key_value_heads": 4,
                "max_position_embeddings": 4 * config.seq, "tie_word_embeddings": False}  # fmt: skip
    key = hashlib.blake2b(repr(sorted(settings.items())).encode(), digest_size=6).hexdigest()
    folder = os.path.join(tempfile.gettempdir(), f"wrapperroute-tiny-llama-{key}")
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(folder, "config.json")):
        partial = tempfile.mkdtemp(prefix=f"{os.path.basename(folder)}-", dir=os.path.dirname(folder))
        with torch.random.fork_rng():
            torch.manual_seed(0)
            LlamaForCausalLM(LlamaConfig(**settings)).save_pretrained(partial)
        os.replace(partial, folder)  # whole or not at all: another run may read it
    dist.barrier()
    return folder


def build_hf_tp(model: nn.Module, opts: dict[str, Any]) -> Wrapped:
    """opts: ``tp``. transformers loads a tiny Llama (the check model's sizes) with its own tensor-parallel plan
    (``colwise_gather_output`` head) and, over the other ranks, its own FSDP2 plan; the one-process reference
    loads the same folder plainly."""
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    config = model.config if isinstance(model, TinyCausalLM) else None
    folder = _tiny_llama(config)
    tp = int(opts["tp"])
    world = dist.get_world_size()
    layout = DistributedConfig(tp_size=tp, fsdp_size=world // tp)
    loaded = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, distributed_config=layout)
    twin = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    weight: Any = loaded.lm_head.weight
    mesh = weight.device_mesh
    names = list(mesh.mesh_dim_names or ())
    if mesh.ndim == 1:  # tensor parallel alone: one data-parallel replica
        return _wrapped(loaded, 0, 1, twin)
    data = next(dim for dim, name in enumerate(names) if name != "tp")  # transformers calls it "fsdp"
    return _wrapped(loaded, mesh.get_local_rank(data), mesh.size(data), twin)
