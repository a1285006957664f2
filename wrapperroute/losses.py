"""Fused linear losses that are exact on a vocabulary-sharded head, without ever gathering the vocabulary.

``linear_logprobs(hidden, weight, target)`` and ``linear_cross_entropy(hidden, weight, target)`` compute from
hidden states ``(N, H)`` and a head weight ``(V, H)`` that is a plain tensor, or a ``DTensor`` sharded on the
vocabulary over one mesh dimension (tensor parallelism: ``ColwiseParallel`` on ``lm_head``, transformers'
``colwise_gather_output``). Tokens go through in chunks, so no more than ``chunk_size x V/tp`` logits are ever
alive on a rank, and the head's weight stays sharded.

The algorithm is the known exact one (Megatron's vocab-parallel cross-entropy, torch's ``loss_parallel``): per
chunk, each rank takes its slice of the logits, and three small all-reduces over the tensor-parallel group give
every rank each row's maximum, sum of exponentials and target logit (only the rank whose slice holds the target
contributes it). The backward is local for the weight's shard; the hidden states' gradient is the sum of every
rank's part, all-reduced over the tensor-parallel group. Gradients reach the ``DTensor`` as its shard, as the
optimizer holds it. Statistics and gradients accumulate in float32 for half, bfloat16 and float32 inputs
(float64 for float64).

Why an autograd function and not torch's ``loss_parallel``: that context needs the logits materialised as one
``DTensor`` and the backward run inside it, so every chunk's ``N x V/tp`` logits would stay alive for the
backward; here the backward recomputes (log-probabilities) or was computed chunk by chunk in the forward (a
mean or summed cross-entropy) and only per-row statistics are kept. ``benchmarks/tp_loss.py`` measures both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from .errors import RouteTypeError, RouteValueError

__all__ = ["linear_cross_entropy", "linear_logprobs"]

Reduction = Literal["mean", "sum", "none"]


@dataclass(frozen=True)
class _Shard:
    """This rank's slice of the vocabulary: rows ``offset .. offset + local.shape[0]`` of the head, and the group
    holding the other slices (None: the whole head is here)."""

    local: torch.Tensor
    offset: int
    vocab: int
    group: Any


def _vocab_shard(weight: torch.Tensor) -> _Shard:
    """The local slice of a head weight: the tensor itself, or a DTensor's local part (differentiable back to
    the DTensor) with where it sits in the vocabulary."""
    placements = getattr(weight, "placements", None)
    mesh = getattr(weight, "device_mesh", None)
    if placements is None or mesh is None:
        return _Shard(weight, 0, weight.shape[0], None)
    dims = [d for d, p in enumerate(placements) if not p.is_replicate()]
    if any(placements[d].is_partial() for d in dims):
        raise RouteValueError("weight is a DTensor with a Partial placement: reduce it before reading it as a head")
    if any(getattr(placements[d], "dim", None) != 0 for d in dims):
        raise RouteValueError(
            f"weight is sharded on its hidden dimension ({placements}): a vocabulary-parallel loss needs the head "
            "sharded on the vocabulary (dimension 0, ColwiseParallel), or whole"
        )
    if len(dims) > 1:
        raise RouteValueError(
            f"weight is sharded over {len(dims)} mesh dimensions ({placements} on {mesh}): only the tensor-parallel "
            "one may remain. Inside the data-parallel wrapper's forward (wrapperroute.route_loss) FSDP gathers its "
            "own dimension: call the loss there."
        )
    local = weight.to_local()  # type: ignore[attr-defined]
    if not dims:
        return _Shard(local, 0, weight.shape[0], None)
    dim = dims[0]
    ranks, coordinate, vocab = mesh.size(dim), mesh.get_local_rank(dim), weight.shape[0]
    # Shard(0) splits as torch.chunk does: ceil(V / ranks) rows each, the last ones shorter or empty
    rows = -(-vocab // ranks)
    offset = min(coordinate * rows, vocab)
    if local.shape[0] != max(0, min(rows, vocab - offset)):
        raise RouteValueError(
            f"weight's local shard has {local.shape[0]} rows where an even Shard(0) split of {vocab} over {ranks} "
            f"ranks gives {max(0, min(rows, vocab - offset))}: an uneven or strided sharding is not supported"
        )
    return _Shard(local, offset, vocab, mesh.get_group(dim))


def _local_whole(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """A plain tensor as it is; a replicated DTensor's local copy."""
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return tensor
    if not all(p.is_replicate() for p in placements):
        raise RouteValueError(f"{name} must be whole on every tensor-parallel rank (Replicate), got {placements}")
    local: torch.Tensor = tensor.to_local()  # type: ignore[attr-defined]
    return local


def _check(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> None:
    for name, value in (("hidden", hidden), ("weight", weight), ("target", target)):
        if not isinstance(value, torch.Tensor):
            raise RouteTypeError(f"{name} must be a tensor, got {type(value).__name__}")
    if weight.dim() != 2:
        hint = (" (a ZeRO-3 partitioned parameter read outside the engine's forward has 0 elements: compute the loss "
                "inside it, wrapperroute.route_loss)") if weight.numel() == 0 else ""  # fmt: skip
        raise RouteValueError(f"weight must be the head's (V, H) matrix, got shape {tuple(weight.shape)}{hint}")
    if hidden.dim() != 2 or hidden.shape[1] != weight.shape[-1]:
        raise RouteValueError(
            f"hidden must be (N, H) with H = weight.shape[1] = {weight.shape[-1]}, got {tuple(hidden.shape)}; "
            "flatten batch and sequence first (hidden.flatten(0, 1))"
        )
    if target.shape != hidden.shape[:1]:
        raise RouteValueError(f"target must be (N,) = ({hidden.shape[0]},), got {tuple(target.shape)}")


# A chunk's logits may hold as many elements as the hidden states, and at least this many (8 MiB of float32):
# smaller chunks spend their time re-reading the weight's gradient, each chunk adding its part to all of it.
_CHUNK_ELEMENTS = 1 << 21


def _chunk_rows(rows: int, hidden_size: int, local_vocab: int, chunk_size: int | None) -> int:
    """Rows per chunk: given, or so that a chunk's logits hold no more than the hidden states, or 8 MiB of
    float32 where that is more."""
    if chunk_size is not None:
        if chunk_size < 1:
            raise RouteValueError(f"chunk_size must be a positive number of rows, got {chunk_size}")
        return chunk_size
    budget = max(rows * hidden_size, _CHUNK_ELEMENTS)
    return max(1, min(rows, budget // max(local_vocab, 1)))


def _statistics(
    logits: torch.Tensor, target: torch.Tensor, shard: _Shard
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's log-sum-exp over the whole vocabulary, its target's logit, and one over its sum of
    exponentials, from this rank's slice of the logits: one MAX and one SUM all-reduce over the tensor-parallel
    group. The slice is turned into ``exp(logits - row maximum)`` in place: times the last, the softmax."""
    # a rank holding no vocabulary row (more ranks than rows) contributes -inf
    largest = logits.max(dim=1).values if logits.shape[1] else logits.new_full((logits.shape[0],), -math.inf)
    if shard.group is not None:
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=shard.group)
    local = target - shard.offset
    mine = (local >= 0) & (local < logits.shape[1])
    if logits.shape[1]:
        picked = logits.gather(1, local.clamp(0, logits.shape[1] - 1).unsqueeze(1)).squeeze(1)
    else:
        picked = logits.new_zeros(logits.shape[0])
    exps = logits.sub_(largest.unsqueeze(1)).exp_()
    sums = torch.stack([exps.sum(dim=1), torch.where(mine, picked, 0.0)])
    if shard.group is not None:
        dist.all_reduce(sums, group=shard.group)
    return largest + sums[0].log(), sums[1], sums[0].reciprocal()


def _minus_onehot(softmax: torch.Tensor, target: torch.Tensor, shard: _Shard) -> torch.Tensor:
    """d(-log p(target)) / d(logits) on this rank's slice: the softmax, minus one at the target where this slice
    holds it (in place)."""
    local = target - shard.offset
    mine = ((local >= 0) & (local < softmax.shape[1])).nonzero().squeeze(1)
    softmax[mine, local[mine]] -= 1.0
    return softmax


def _finish_hidden_grad(grad: torch.Tensor, shard: _Shard) -> torch.Tensor:
    """Every rank's part of the hidden states' gradient summed: each slice of the vocabulary contributes."""
    if shard.group is not None:
        dist.all_reduce(grad, group=shard.group)
    return grad


def _accumulating(tensor: torch.Tensor) -> torch.dtype:
    """Float32 for half, bfloat16 and float32 inputs; float64 kept."""
    return torch.promote_types(tensor.dtype, torch.float32)


def _buffers(
    ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, grad_enabled: bool = True
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Float32 gradient accumulators for the inputs that need one (a frozen reference head needs none; nothing
    needs one under ``no_grad``, which ``needs_input_grad`` does not see)."""
    needs_hidden, needs_weight = (need and grad_enabled for need in ctx.needs_input_grad[:2])
    dtype = _accumulating(hidden)
    return (torch.zeros(hidden.shape, dtype=dtype, device=hidden.device) if needs_hidden else None,
            torch.zeros(weight.shape, dtype=dtype, device=weight.device) if needs_weight else None)  # fmt: skip


def _accumulate(
    grad: torch.Tensor, rows: slice, hidden: torch.Tensor, weight: torch.Tensor,
    grad_hidden: torch.Tensor | None, grad_weight: torch.Tensor | None,
) -> None:  # fmt: skip
    """One chunk's gradient of the logits, taken back to the hidden states (its rows) and the weight's shard."""
    if grad_hidden is not None:
        grad_hidden[rows] = grad.to(weight.dtype) @ weight
    if grad_weight is not None:
        grad_weight.addmm_(grad.t(), hidden[rows].to(grad.dtype))


class _LogProbs(torch.autograd.Function):
    """log p(target) per token. Keeps one float per row (the log-sum-exp); the backward recomputes each chunk's
    logits, since the gradient flowing in is only known then."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, shard: _Shard, chunk: int
    ) -> torch.Tensor:
        out = torch.empty(hidden.shape[0], dtype=_accumulating(hidden), device=hidden.device)
        lses = torch.empty_like(out)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = (hidden[rows] @ weight.t()).to(_accumulating(hidden))
            lse, picked, _ = _statistics(logits, target[rows], shard)
            out[rows], lses[rows] = picked - lse, lse
        ctx.save_for_backward(hidden, weight, target, lses)
        ctx.shard, ctx.chunk = shard, chunk
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, target, lses = ctx.saved_tensors
        shard: _Shard = ctx.shard
        grad_hidden, grad_weight = _buffers(ctx, hidden, weight)
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            logits = (hidden[rows] @ weight.t()).to(_accumulating(hidden))
            # d log p / d logits = onehot - softmax, times the incoming gradient of each row
            softmax = logits.sub_(lses[rows].unsqueeze(1)).exp_()
            grad = _minus_onehot(softmax, target[rows], shard).mul_(-grad_out[rows].unsqueeze(1))
            _accumulate(grad, rows, hidden, weight, grad_hidden, grad_weight)
        if grad_hidden is not None:
            grad_hidden = _finish_hidden_grad(grad_hidden, shard).to(hidden.dtype)
        return grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None, None, None, None


class _CrossEntropy(torch.autograd.Function):
    """Mean or summed cross-entropy whose gradients are computed chunk by chunk in the forward (the incoming
    gradient is one number, known only in the backward, which scales them): each chunk's logits are freed as
    soon as its gradients are taken."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, shard: _Shard, chunk: int,
        ignore_index: int, mean: bool, grad_enabled: bool,
    ) -> torch.Tensor:  # fmt: skip
        keep = target != ignore_index
        dtype = _accumulating(hidden)
        count = keep.sum().to(dtype)
        # no token kept: the loss is NaN (0/0, as torch's) and the gradients 0 (as torch's), not 0 * inf
        scale = 1.0 / count.clamp_min(1) if mean else torch.ones((), dtype=dtype, device=hidden.device)
        grad_hidden, grad_weight = _buffers(ctx, hidden, weight, grad_enabled)
        total = torch.zeros((), dtype=_accumulating(hidden), device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = (hidden[rows] @ weight.t()).to(_accumulating(hidden))
            lse, picked, inverse = _statistics(logits, target[rows], shard)
            kept = keep[rows]
            total += torch.where(kept, lse - picked, 0.0).sum()
            if grad_hidden is not None or grad_weight is not None:
                softmax = logits.mul_(inverse.unsqueeze(1))
                grad = _minus_onehot(softmax, target[rows], shard).mul_(kept.unsqueeze(1) * scale)
                _accumulate(grad, rows, hidden, weight, grad_hidden, grad_weight)
        if grad_hidden is not None:
            grad_hidden = _finish_hidden_grad(grad_hidden, shard)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return total / count if mean else total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        # the common incoming gradient, 1: the gradients as they are, no copy of the weight's (one number read)
        one = grad_out.numel() == 1 and float(grad_out) == 1.0
        scaled = [None if g is None else (g if one else g * grad_out).to(d)
                  for g, d in ((grad_hidden, hidden_dtype), (grad_weight, weight_dtype))]  # fmt: skip
        return scaled[0], scaled[1], None, None, None, None, None, None


def _operands(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, chunk_size: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, _Shard, int]:
    _check(hidden, weight, target)
    shard = _vocab_shard(weight)
    hidden = _local_whole(hidden, "hidden")
    target = _local_whole(target, "target")
    if hidden.dtype != shard.local.dtype:
        raise RouteTypeError(f"hidden ({hidden.dtype}) and weight ({shard.local.dtype}) must share a dtype")
    chunk = _chunk_rows(hidden.shape[0], hidden.shape[1], shard.local.shape[0], chunk_size)
    return hidden, shard.local, target.long(), shard, chunk


def linear_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, chunk_size: int | None = None
) -> torch.Tensor:
    """``log p(target)`` of each token under ``softmax(hidden @ weight.T)``, in float32 (float64 for float64
    inputs), shaped like ``target``.

    ``hidden`` is ``(N, H)``, ``weight`` the head's ``(V, H)``: a plain tensor, or a DTensor sharded on the
    vocabulary over one mesh dimension (its other dimensions replicated). ``target`` holds ``N`` token ids in
    ``[0, V)``; one outside gives ``-logsumexp`` of its row: mask such rows yourself. ``chunk_size``: rows per
    chunk (default: a chunk's logits no larger than ``hidden``, or 8 MiB of float32 where that is more). The
    preference losses (DPO, KTO) are built on these; see ``docs/tensor-parallel.md``.
    """
    hidden, local, target, shard, chunk = _operands(hidden, weight, target, chunk_size)
    out: torch.Tensor = _LogProbs.apply(hidden, local, target, shard, chunk)
    return out


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(hidden @ weight.T, target)``, never materialising the logits, exact on a head sharded on
    the vocabulary.

    ``hidden`` ``(N, H)``; ``weight`` ``(V, H)``, plain or a DTensor sharded on the vocabulary over one mesh
    dimension; ``target`` ``(N,)``, ``ignore_index`` ignored. ``reduction``: ``"mean"`` over the tokens not
    ignored (NaN when none is, as torch), ``"sum"``, or ``"none"`` (per token, 0 where ignored). Accumulates and
    returns float32 (float64 for float64 inputs). Under data parallelism, ``"sum"`` divided by
    :func:`wrapperroute.token_divisor` is the mean over every valid token of the global batch (each rank's
    ``"mean"`` is not, once ranks hold different numbers of them); a rank whose tokens are all ignored gives 0
    and zero gradients.
    """
    if reduction not in ("mean", "sum", "none"):
        raise RouteValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    hidden, local, target, shard, chunk = _operands(hidden, weight, target, chunk_size)
    if reduction == "none":
        keep = target != ignore_index
        safe = torch.where(keep, target, 0)
        nll = -_LogProbs.apply(hidden, local, safe, shard, chunk)
        return torch.where(keep, nll, 0.0)
    out: torch.Tensor = _CrossEntropy.apply(
        hidden, local, target, shard, chunk, ignore_index, reduction == "mean", torch.is_grad_enabled()
    )
    return out
