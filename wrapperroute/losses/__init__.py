"""Fused linear losses that are exact on a vocabulary-sharded head, without ever gathering the vocabulary.

``linear_logprobs(hidden, weight, target)`` (with the entropy when asked) and ``linear_cross_entropy(hidden,
weight, target)`` (with label smoothing and z-loss) compute from hidden states ``(N, H)`` and a head weight
``(V, H)`` (and bias ``(V,)``) that is a plain tensor, or a ``DTensor`` sharded on the vocabulary over one mesh
dimension (tensor parallelism: ``ColwiseParallel`` on ``lm_head``, transformers' ``colwise_gather_output``).
The logits are TRL's: ``z = (hidden @ W.T + bias) * logit_scale``, capped ``softcap * tanh(z / softcap)``, over
``temperature``. Tokens go through in chunks, so no more than ``chunk_size x V/tp`` logits (two or three such
buffers with the entropy's gradient and a cap) are ever alive on a rank, and the head's weight stays sharded.
Hidden states sharded on tokens (sequence parallelism) are gathered, never the head.

The algorithm is the known exact one (Megatron's vocab-parallel cross-entropy, torch's ``loss_parallel``): per
chunk, each rank takes its slice of the logits, and two small all-reduces over the tensor-parallel group give
every rank each row's maximum, then its sum of exponentials and target logit (only the rank whose slice holds
the target contributes it), and the sums the entropy and label smoothing need. The backward is local for the
weight's and bias's shards; the hidden states' gradient is the sum of every rank's part, all-reduced over the
tensor-parallel group. Gradients reach the ``DTensor`` as its shard, as the optimizer holds it. Statistics and
gradients accumulate in float32 for half, bfloat16 and float32 inputs (float64 for float64).

Why autograd functions and not torch's ``loss_parallel``: that context needs the logits materialised as one
``DTensor`` and the backward run inside it, so every chunk's ``N x V/tp`` logits would stay alive for the
backward; here the backward recomputes (per-token results) or was computed chunk by chunk in the forward (a
mean or summed cross-entropy) and only per-row statistics are kept. ``benchmarks/tp_loss.py`` measures both,
``benchmarks/logprob_cost.py`` against TRL's ``ChunkedLogProbFunction``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..errors import RouteTypeError, RouteValueError
from ._functions import PerToken, Summed
from ._layout import Tokens, bias_slice, check_shapes, check_targets, token_layout, vocab_shard
from ._rows import Plan, chunk_rows

__all__ = ["linear_cross_entropy", "linear_logprobs"]

Reduction = Literal["mean", "sum", "none"]


@dataclass(frozen=True)
class _Call:
    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    target: torch.Tensor
    plan: Plan
    tokens: Tokens


def _number(name: str, value: Any, low: float, *, low_included: bool = False, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RouteValueError(f"{name} must be a number, got {value!r}")
    inside = (value >= low if low_included else value > low) and value <= high
    if not (math.isfinite(value) and inside):
        bounds = f"{'[' if low_included else '('}{low}, {high}{']' if math.isfinite(high) else ')'}"
        raise RouteValueError(f"{name} must be a finite number in {bounds}, got {value!r}")
    return float(value)


def _prepare(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
    chunk_size: int | None, per_token: bool, **options: Any,
) -> _Call:  # fmt: skip
    """Checks every operand (the targets' values included: one reduction, read on the host), takes the head's
    and bias's slices, gathers hidden states and targets sharded on tokens, and plans the chunks."""
    check_shapes(hidden, weight, target)
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise RouteValueError(f"chunk_size must be a positive number of rows, got {chunk_size!r}")
    ignore_index = options["ignore_index"]
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise RouteValueError(f"ignore_index must be an int, got {ignore_index!r}")
    temperature = _number("temperature", options.pop("temperature"), 0.0)
    softcap = options.pop("softcap")
    softcap = None if softcap is None else _number("softcap", softcap, 0.0)
    logit_scale = _number("logit_scale", options.pop("logit_scale"), -math.inf)
    shard = vocab_shard(weight)
    local_bias = bias_slice(bias, shard)
    target, _ = token_layout(target, "target")
    target = target.detach()
    # before any collective: every tensor-parallel rank holds the same targets and raises alike
    check_targets(target, shard.vocab, ignore_index)
    hidden, tokens = token_layout(hidden, "hidden")
    if hidden.dtype != shard.local.dtype:
        raise RouteTypeError(f"hidden ({hidden.dtype}) and weight ({shard.local.dtype}) must share a dtype")
    chunk = chunk_rows(hidden.shape[0], hidden.shape[1], shard.local.shape[0], chunk_size, per_token)
    plan = Plan(logit_scale, softcap, temperature, shard.offset, shard.vocab, shard.group, chunk, **options)
    return _Call(hidden, shard.local, local_bias, target.long(), plan, tokens)


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    outputs: tuple[str, ...] | None = None,
    chunk_size: int | None = None,
) -> Any:
    """``log p(target)`` of each token under ``softmax(z)``, ``z`` TRL's logits: ``(hidden @ weight.T + bias) *
    logit_scale``, then ``softcap * tanh(z / softcap)`` when ``softcap`` is set, then ``z / temperature``. In
    float32 (float64 for float64 inputs), shaped like ``target``; 0, with no gradient, where ``target ==
    ignore_index``.

    ``return_entropy``: ``(logprobs, entropy)``, the entropy ``-sum p log p`` of the same distribution, both
    differentiable; the backward skips the entropy's terms when no gradient reaches it (logged only).

    ``outputs``: the per-token fields of TRL's fused LM head instead, by its names, returned as a dict of them:
    ``"log_probs"`` (always computed), ``"entropy"``, and, without gradient, ``"log_sum_sq_probs"`` (``log sum
    p^2``), ``"mean_logits"`` (the mean of ``z`` over the vocabulary) and ``"is_top1"`` (the target is the
    first most likely word, as ``argmax``); each 0 (False) where ``target == ignore_index``. Not with
    ``return_entropy``.

    ``hidden`` is ``(N, H)``: plain, or a DTensor (replicated, or sharded on tokens, ``Shard(0)``: gathered over
    its mesh, and the results come back as DTensors sharded the same way, each rank its own rows, gradients
    reaching each rank's rows). ``weight`` the head's ``(V, H)``: plain, or a DTensor sharded on the vocabulary
    over one mesh dimension (its other dimensions replicated), never gathered; ``bias`` ``(V,)`` laid out as the
    weight is. ``target`` holds ``N`` token ids in ``[0, V)`` or ``ignore_index`` (every rank's, whole, or a
    DTensor sharded as ``hidden``); anything else raises ``RouteValueError`` naming the first bad position and
    value, on every tensor-parallel rank alike. That check is one reduction over the targets read on the host,
    so it waits for the device (a CUDA synchronisation). ``chunk_size``: rows per chunk (default: a chunk's
    logits no larger than ``hidden``, or 32 MiB of float32 where that is more). The preference losses (DPO, KTO)
    are built on these; see ``docs/tensor-parallel.md``.
    """
    fields = _fields(outputs, return_entropy)
    switches = {name: True for name in fields if name != "log_probs"}  # the plan's fields carry TRL's names
    call = _prepare(hidden, weight, target, bias, chunk_size, True, temperature=temperature, softcap=softcap,
                    logit_scale=logit_scale, ignore_index=ignore_index, **switches)  # fmt: skip
    found = PerToken.apply(call.hidden, call.weight, call.bias, call.target, call.plan, "logprob")
    if outputs is not None:
        return {name: call.tokens.give_back(found[_FIELDS.index(name)]) for name in fields}
    if return_entropy:
        return call.tokens.give_back(found[0]), call.tokens.give_back(found[1])
    return call.tokens.give_back(found[0])


# TRL's names for the per-token fields of its fused LM head, in PerToken's order.
_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _fields(outputs: Any, return_entropy: bool) -> tuple[str, ...]:
    if outputs is None:
        return ("log_probs", "entropy") if return_entropy else ("log_probs",)
    if return_entropy:
        raise RouteValueError("pass either return_entropy or outputs (with 'entropy' among them), not both")
    if isinstance(outputs, str) or not all(isinstance(name, str) for name in outputs):
        raise RouteValueError(f"outputs must be a tuple of field names among {_FIELDS}, got {outputs!r}")
    unknown = [name for name in outputs if name not in _FIELDS]
    if unknown:
        raise RouteValueError(f"unknown output(s) {unknown}: choose among {_FIELDS}")
    return tuple(name for name in _FIELDS if name == "log_probs" or name in outputs)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    ignore_index: int = -100,
    reduction: Reduction = "mean",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(z, target, ignore_index=..., label_smoothing=..., reduction=...)`` plus ``z_loss *
    logsumexp(z)^2`` per token not ignored (Liger's ``lse_square_scale``), never materialising the logits ``z``
    (TRL's transform, as :func:`linear_logprobs`), exact on a head sharded on the vocabulary.

    Per token not ignored: ``(1 - eps) (lse - z[target]) + eps (lse - mean(z)) + z_loss lse^2``, ``eps`` the
    label smoothing, as torch's. ``reduction``: ``"mean"`` over the tokens not ignored (NaN when none is, as
    torch), ``"sum"``, or ``"none"`` (per token, 0 where ignored; shaped and laid out as
    :func:`linear_logprobs`' results); a mean or sum is a plain 0-dim tensor, the same on every tensor-parallel
    rank. Operands and the targets' check as :func:`linear_logprobs`. Accumulates and returns float32 (float64 for
    float64 inputs). Under data parallelism, ``"sum"`` divided by :func:`wrapperroute.token_divisor` is the mean
    over every valid token of the global batch (each rank's ``"mean"`` is not, once ranks hold different numbers
    of them); a rank whose tokens are all ignored gives 0 and zero gradients.
    """
    if reduction not in ("mean", "sum", "none"):
        raise RouteValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    call = _prepare(hidden, weight, target, bias, chunk_size, reduction == "none", temperature=temperature,
                    softcap=softcap, logit_scale=logit_scale, ignore_index=ignore_index,
                    label_smoothing=_number("label_smoothing", label_smoothing, 0.0, low_included=True, high=1.0),
                    z_loss=_number("z_loss", z_loss, 0.0, low_included=True))  # fmt: skip
    if reduction == "none":
        per_token: torch.Tensor = PerToken.apply(call.hidden, call.weight, call.bias, call.target, call.plan, "loss")[0]
        return call.tokens.give_back(per_token)
    out: torch.Tensor = Summed.apply(
        call.hidden, call.weight, call.bias, call.target, call.plan, reduction == "mean", torch.is_grad_enabled()
    )
    return out
