"""Losses that read ``lm_head.weight`` directly instead of calling the module: the pattern that skips the
wrapper's forward. Each knows how to make a per-rank batch and how to concatenate rank batches into the global
batch a single process would see, so gradient truth can be checked for pairwise losses (DPO) too."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .models import TinyCausalLM, TinyConfig, build_model
from .wrappers import missing_package

Batch = dict[str, torch.Tensor]


def _ids(config: TinyConfig, rows: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, config.vocab, (rows, config.seq), generator=generator)


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


@dataclass
class LossCase:
    """One loss: how to make data for it and how to compute it from the *unwrapped* model.

    ``compute`` is the loss as a mean over the batch it is given (over its valid tokens, or its sequences). A
    token-level loss also has ``summed``, the sum over the valid tokens, and ``count``, how many they are: its
    cells divide ``summed`` by :func:`wrapperroute.token_divisor` of the step's count, and its batches hold
    different numbers of valid tokens on every rank and micro-batch."""

    name: str
    make_batch: Callable[[TinyConfig, torch.Generator, int], Batch]
    compute: Callable[[TinyCausalLM, Batch, dict[str, Any]], torch.Tensor]
    requires: str | None = None  # optional package
    extras: Callable[[TinyConfig], dict[str, Any]] = field(default=lambda config: {})
    config: TinyConfig = field(default_factory=TinyConfig)  # the default model size for this loss
    summed: Callable[[TinyCausalLM, Batch, dict[str, Any]], torch.Tensor] | None = None
    count: Callable[[Batch], int] | None = None

    def unavailable(self) -> str | None:
        """Why this loss cannot run here, or None."""
        return missing_package(self.requires)

    def available(self) -> bool:
        return self.unavailable() is None

    def concat(self, batches: list[Batch]) -> Batch:
        # Key by key, so DPO's chosen and rejected halves stay grouped as a single process would see them.
        return {key: torch.cat([b[key] for b in batches]) for key in batches[0]}


# --- plain fused cross-entropy -------------------------------------------------------------------------------


def _ce_batch(config: TinyConfig, generator: torch.Generator, rows: int) -> Batch:
    ids = _ids(config, rows, generator)
    return {"input_ids": ids, "labels": torch.roll(ids, -1, dims=1)}


IGNORE = -100  # F.cross_entropy's and linear_cross_entropy's default ignore_index


def mask_labels(batch: Batch, generator: torch.Generator) -> Batch:
    """The batch with each row's first labels ignored, as a prompt mask or left padding does: each row keeps a
    drawn number of valid labels, from one to all, so ranks and micro-batches hold different numbers of them."""
    labels = batch["labels"]
    rows, seq = labels.shape
    kept = torch.randint(1, seq + 1, (rows, 1), generator=generator)
    return {**batch, "labels": torch.where(torch.arange(seq) >= seq - kept, labels, IGNORE)}


def valid_tokens(batch: Batch) -> int:
    """The labels not ignored: what a token-level loss averages over."""
    return int((batch["labels"] != IGNORE).sum())


def fused_cross_entropy(
    model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """The fused-loss pattern, the one definition the check, the tests and the benchmarks share: the tiny LM's
    hidden states times ``lm_head.weight`` read directly (the weight, not the module), then cross-entropy."""
    head: Any = model.lm_head
    logits = model(input_ids) @ head.weight.t()
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction=reduction)


def _fused_ce(model: TinyCausalLM, batch: Batch, extras: dict[str, Any]) -> torch.Tensor:
    return fused_cross_entropy(model, batch["input_ids"], batch["labels"])


def _fused_ce_sum(model: TinyCausalLM, batch: Batch, extras: dict[str, Any]) -> torch.Tensor:
    return fused_cross_entropy(model, batch["input_ids"], batch["labels"], "sum")


def _backbone_logits(model: TinyCausalLM, batch: Batch) -> torch.Tensor:
    # The submodules called one by one, never the root: HF's ``unwrapped.model(...)`` then the head's weight.
    # Where the wrapper is the root's own forward hooks (composable replicate, FSDP2), this skips them too.
    hidden = model.embed(batch["input_ids"])
    for block in model.blocks:
        hidden = block(hidden)
    return (hidden @ model.lm_head.weight.t()).flatten(0, 1).float()


def _backbone_ce(model: TinyCausalLM, batch: Batch, extras: dict[str, Any]) -> torch.Tensor:
    return F.cross_entropy(_backbone_logits(model, batch), batch["labels"].flatten())


def _backbone_ce_sum(model: TinyCausalLM, batch: Batch, extras: dict[str, Any]) -> torch.Tensor:
    return F.cross_entropy(_backbone_logits(model, batch), batch["labels"].flatten(), reduction="sum")


# --- Liger chunked preference losses (torch.func inside torch.compile) --------------------------------------

# Large enough that the two requires-grad heads span >= 2 DDP buckets: the upstream TensorWrapper crash.
LIGER_CONFIG = TinyConfig(vocab=8192, hidden=256, layers=1, seq=8)


def _reference_extras(config: TinyConfig) -> dict[str, Any]:
    """A reference model whose head is *not* frozen, as TRL's DPO loads it."""
    ref_backbone = build_model(config, seed=1).requires_grad_(False)
    ref_head = copy.deepcopy(ref_backbone.lm_head).requires_grad_(True)
    return {"ref_backbone": ref_backbone, "ref_head": ref_head}


def _pair_batch(config: TinyConfig, generator: torch.Generator, rows: int) -> Batch:
    return {"chosen": _ids(config, rows, generator), "rejected": _ids(config, rows, generator)}


def _liger_dpo(model: TinyCausalLM, batch: Batch, extras: dict[str, Any]) -> torch.Tensor:
    from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

    ids = torch.cat([batch["chosen"], batch["rejected"]])
    target = torch.roll(ids, -1, dims=1)
    hidden = model(ids)
    with torch.no_grad():
        ref_hidden = extras["ref_backbone"](ids)
    loss_fn = extras.setdefault("dpo", LigerFusedLinearDPOLoss(beta=0.1))  # compiled=True: the default
    return _first(
        loss_fn(model.lm_head.weight, hidden, target, ref_input=ref_hidden, ref_weight=extras["ref_head"].weight)
    )


def _kto_batch(config: TinyConfig, generator: torch.Generator, rows: int) -> Batch:
    ids = _ids(config, rows, generator)
    return {"input_ids": ids, "preference": torch.arange(rows) % 2 == 0}


def _liger_kto(model: TinyCausalLM, batch: Batch, extras: dict[str, Any]) -> torch.Tensor:
    from liger_kernel.chunked_loss import LigerFusedLinearKTOLoss

    ids = batch["input_ids"]
    hidden = model(ids)
    with torch.no_grad():
        ref_hidden = extras["ref_backbone"](ids)
    loss_fn = extras.setdefault("kto", LigerFusedLinearKTOLoss(use_ref_model=True))
    return _first(
        loss_fn(
            hidden,
            model.lm_head.weight,
            torch.roll(ids, -1, dims=1),
            preference_labels=batch["preference"],
            ref_input=ref_hidden,
            ref_weight=extras["ref_head"].weight,
        )
    )


# --- a hand-written torch.func chunked loss -------------------------------------------------------------------


class _ChunkedCE(torch.autograd.Function):
    """Cross-entropy whose gradients are computed in forward, chunk by chunk, with ``torch.func``: the
    structure of Liger's losses without Liger."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        rows = hidden.shape[0]

        def chunk_loss(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(h @ w.t(), y, reduction="sum") / rows

        grad_and_value = torch.func.grad_and_value(chunk_loss, argnums=(0, 1))
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros_like(weight)
        loss = hidden.new_zeros(())
        for h, y, gh in zip(hidden.split(4), labels.split(4), grad_hidden.split(4), strict=True):
            (g_h, g_w), value = grad_and_value(h, weight, y)
            gh.copy_(g_h)
            grad_weight += g_w
            loss += value
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_output, grad_weight * grad_output, None


def _func_chunked(model: TinyCausalLM, batch: Batch, extras: dict[str, Any]) -> torch.Tensor:
    hidden = model(batch["input_ids"]).flatten(0, 1)
    out: torch.Tensor = _ChunkedCE.apply(hidden, model.lm_head.weight, batch["labels"].flatten())
    return out


# --- wrapperroute.losses' primitives: a head read whole or sharded on the vocabulary ----------------------------


def hidden_states(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The final hidden states, (batch, seq, hidden): the tiny LM's forward, or a transformers model's base."""
    if isinstance(model, TinyCausalLM):
        return model(ids)
    base: Any = model.get_submodule("model")
    return base(input_ids=ids).last_hidden_state


def _vocab_ce(model: nn.Module, batch: Batch, extras: dict[str, Any], reduction: Any = "mean") -> torch.Tensor:
    from ..losses import linear_cross_entropy

    head: Any = model.get_submodule("lm_head")
    hidden = hidden_states(model, batch["input_ids"]).flatten(0, 1)
    return linear_cross_entropy(hidden, head.weight, batch["labels"].flatten(), reduction=reduction, chunk_size=5)


def _vocab_ce_sum(model: nn.Module, batch: Batch, extras: dict[str, Any]) -> torch.Tensor:
    return _vocab_ce(model, batch, extras, "sum")


def _vocab_dpo(model: nn.Module, batch: Batch, extras: dict[str, Any]) -> torch.Tensor:
    """DPO without a reference model (its log-ratios are the policy's log-probabilities), on
    ``linear_logprobs``: each sequence's log-probability summed over its tokens."""
    from ..losses import linear_logprobs

    ids = torch.cat([batch["chosen"], batch["rejected"]])
    head: Any = model.get_submodule("lm_head")
    hidden = hidden_states(model, ids).flatten(0, 1)
    logps = linear_logprobs(hidden, head.weight, torch.roll(ids, -1, dims=1).flatten(), chunk_size=5)
    chosen, rejected = logps.view(ids.shape).sum(dim=1).chunk(2)
    return -F.logsigmoid(0.1 * (chosen - rejected)).mean()


LOSSES: dict[str, LossCase] = {
    "fused_ce": LossCase("fused_ce", _ce_batch, _fused_ce, summed=_fused_ce_sum, count=valid_tokens),
    "backbone_ce": LossCase("backbone_ce", _ce_batch, _backbone_ce, summed=_backbone_ce_sum, count=valid_tokens),
    "liger_dpo": LossCase(
        "liger_dpo",
        _pair_batch,
        _liger_dpo,
        requires="liger_kernel",
        extras=_reference_extras,
        config=LIGER_CONFIG,
    ),
    "liger_kto": LossCase(
        "liger_kto",
        _kto_batch,
        _liger_kto,
        requires="liger_kernel",
        extras=_reference_extras,
        config=TinyConfig(vocab=2048, hidden=64, layers=1, seq=8),
    ),
    "func_chunked": LossCase("func_chunked", _ce_batch, _func_chunked),
    "vocab_ce": LossCase("vocab_ce", _ce_batch, _vocab_ce, summed=_vocab_ce_sum, count=valid_tokens),
    "vocab_dpo": LossCase("vocab_dpo", _pair_batch, _vocab_dpo),
}


def make_batch(
    case: LossCase, config: TinyConfig, rank: int, step: int, micro: int, rows: int = 2, uneven: bool = False
) -> Batch:
    """Deterministic per (rank, step, micro-batch): any rank can rebuild every rank's batch. ``uneven``: a
    token-level loss's labels partly ignored (:func:`mask_labels`), a different number on every rank and
    micro-batch; otherwise every label counts."""
    generator = torch.Generator().manual_seed(10_000 + 1000 * step + 100 * micro + rank)
    batch = case.make_batch(config, generator, rows)
    return mask_labels(batch, generator) if uneven and case.summed is not None else batch
