"""Rank bodies for tests/test_trl_fused_head.py (module level: the pool pickles them by reference)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from wrapperroute import check_grad_sync, token_divisor
from wrapperroute.integrations.trl import patch_trl, unpatch_trl

VOCAB, HIDDEN, SEQ = 128, 32, 8


def tiny_llama(family: str = "llama") -> Any:
    """A tiny Llama built from a config (nothing downloaded), the same weights on every rank; or (``mixtral``) a
    tiny Mixtral asking for router logits, its load-balancing coefficient 0: that term is a statistic of the
    whole batch, which no split of the global batch reproduces, while each token's routing is its own."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    common = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 4 * SEQ,
              "tie_word_embeddings": False}  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(0)
        if family == "mixtral":
            return MixtralForCausalLM(MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2,
                                                    output_router_logits=True, router_aux_loss_coef=0.0))  # fmt: skip
        return LlamaForCausalLM(LlamaConfig(**common))


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch: a different number of valid tokens on every rank (prompt masked)."""
    generator = torch.Generator().manual_seed(500 + rank)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    labels = ids.clone()
    labels[:, : 2 + rank] = -100
    return ids, labels


def valid(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != -100).sum())  # the fused head scores position t against label t + 1


def shard(model: Any, layout: str) -> None:
    """Every decoder layer its own FSDP2 unit; the head alone (``head_unit``; ``head_keep``: not resharding
    after forward and the embedding its own unit, what accelerate builds for a model whose final norm it does not
    find) or in the root's group (``root``); prefixed ``hsdp_``, the same over a 2 x (ranks / 2) HSDP mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ranks = dist.get_world_size()
    # hsdp_*: replicated over 2 groups, sharded within each (4 ranks)
    hsdp = layout.startswith("hsdp_")
    names = ("replicate", "shard") if hsdp else ("shard",)
    mesh = init_device_mesh("cpu", (2, ranks // 2) if hsdp else (ranks,), mesh_dim_names=names)
    layout = layout.removeprefix("hsdp_")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    if layout == "head_keep":
        fully_shard(model.model.embed_tokens, mesh=mesh)
    if layout != "root":
        fully_shard(model.lm_head, mesh=mesh, reshard_after_forward=layout == "head_unit")
    fully_shard(model, mesh=mesh)


def fused_head_step(layout: str, patched: bool, family: str = "llama") -> dict[str, Any]:
    """One step of TRL's own fused head (``add_fused_lm_head``, as installed or under ``patch_trl``) on a tiny
    Llama (or Mixtral) under FSDP2, the loss over ``token_divisor`` (``num_items_in_batch``): what
    ``check_grad_sync`` saw and each gradient's largest difference from one process on the global batch."""
    from trl.trainer import utils

    if patched:
        patch_trl()
    try:
        model = tiny_llama(family)
        utils.add_fused_lm_head(model)
        reference = tiny_llama(family)
        utils.add_fused_lm_head(reference)
    finally:
        if patched:
            unpatch_trl()
    shard(model, layout)
    check_grad_sync(model)  # the watch from before the first backward
    rank = dist.get_rank()
    ids, labels = batch(rank)
    divisor = token_divisor(model, valid(labels))
    model(input_ids=ids, labels=labels, fused_lm_head=True, num_items_in_batch=divisor).loss.backward()
    report = check_grad_sync(model)
    diffs = off_one_process(model, reference, dist.get_world_size())
    return {"bypassed": [b.name for b in report.bypassed], "verified": report.verified, "diffs": diffs}


def off_one_process(model: Any, reference: Any, batches: int) -> dict[str, float]:
    """Each gradient's largest difference from ``reference`` stepped in one process on the global batch (the
    first ``batches`` batches), the loss over all their valid tokens."""
    found = [batch(index) for index in range(batches)]
    total = sum(valid(labels) for _, labels in found)
    for ids, labels in found:
        reference(input_ids=ids, labels=labels, fused_lm_head=True, num_items_in_batch=total).loss.backward()
    diffs = {}
    for (name, param), (_, twin) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        grad = param.grad.full_tensor()  # type: ignore[union-attr]
        diffs[name] = float((grad - twin.grad).abs().max())  # type: ignore[operator]
    return diffs


def guard_raises(patched: bool) -> str | None:
    """A step of TRL's fused head on a head in its own FSDP2 unit under ``guard``: the error it raised, if any."""
    from trl.trainer import utils

    from wrapperroute import GradSyncError, guard

    if patched:
        patch_trl()
    try:
        model = tiny_llama()
        utils.add_fused_lm_head(model)
    finally:
        if patched:
            unpatch_trl()
    shard(model, "head_unit")
    ids, labels = batch(dist.get_rank())
    with guard(model):
        try:
            model(input_ids=ids, labels=labels, fused_lm_head=True).loss.backward()
        except GradSyncError as error:
            return str(error)
    return None


def shard_tp(model: Any, layout: str) -> Any:
    """dp2 x tp2 on 4 ranks: the head split on the vocabulary over the tensor-parallel ranks (``ColwiseParallel``),
    every decoder layer its own FSDP2 unit over the data-parallel ranks, the head alone in its own unit
    (``tp_head_unit``) or in the root's group (``tp_root``). Returns the data-parallel coordinate: the ranks of
    one tensor-parallel group see the same batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"lm_head": ColwiseParallel(use_local_output=False)})
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    if layout == "tp_head_unit":
        fully_shard(model.lm_head, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return mesh["dp"].get_local_rank()


def fused_head_tp_step(layout: str, patched: bool) -> dict[str, Any]:
    """One step of TRL's fused head on a head split on the vocabulary under FSDP2 (``shard_tp``), as installed or
    under ``patch_trl``, every field TRL computes asked for: each gradient's largest difference from one process on
    the global batch, and the elements of every head weight ``full_tensor()`` gathered during the step (a no-grad
    forward, as a reference model's, and the training forward and backward)."""
    from torch.distributed.tensor import DTensor
    from trl.trainer import utils

    fields = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    if patched:
        patch_trl()
    try:
        model = tiny_llama()
        utils.add_fused_lm_head(model, outputs=fields)
        reference = tiny_llama()
        utils.add_fused_lm_head(reference, outputs=fields)
    finally:
        if patched:
            unpatch_trl()
    coordinate = shard_tp(model, layout)
    head = model.lm_head
    gathered: list[int] = []
    full_tensor = DTensor.full_tensor

    def counted(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if tensor.shape == head.weight.shape:
            gathered.append(tensor.numel())
        return full_tensor(tensor, *args, **kwargs)

    ids, labels = batch(coordinate)
    divisor = token_divisor(model, valid(labels))
    DTensor.full_tensor = counted  # type: ignore[method-assign]
    try:
        with torch.no_grad():  # as a frozen reference model's forward
            frozen = model(input_ids=ids, labels=labels, fused_lm_head=True).log_probs
        out = model(input_ids=ids, labels=labels, fused_lm_head=True, num_items_in_batch=divisor)
        out.loss.backward()
    finally:
        DTensor.full_tensor = full_tensor  # type: ignore[method-assign]
    assert torch.equal(frozen, out.log_probs.detach()), "the no-grad forward differs from the training one"
    return {"diffs": off_one_process(model, reference, dist.get_world_size() // 2), "gathered": gathered}
