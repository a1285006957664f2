"""One chunk of tokens against this rank's slice of the vocabulary: its logits, each row's statistics over the
whole vocabulary (two all-reduces over the tensor-parallel group), and the gradient of the logits, in place.

Notation: ``a = hidden @ W.T + bias``; the logits are ``z = a * logit_scale``, then ``softcap * tanh(z /
softcap)`` when capped, then ``z / temperature`` (TRL's transform); ``p = softmax(z)`` over the whole vocabulary.
Every gradient of the logits has the form ``p * (alpha + beta * (z - E[z])) - gamma * onehot(target) - delta``
with one coefficient per row (see ``Coefficients``), times ``dz/da``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# A chunk's logits may hold as many elements as the hidden states, and at least this many (8 MiB of float32):
# smaller chunks spend their time re-reading the weight's gradient, each chunk adding its part to all of it.
_CHUNK_ELEMENTS = 1 << 21
# Per-token results go over every logit twice (forward, and the backward's recompute), with the entropy in more
# operations each time: at least 32 MiB, fewer and larger operations (at V=32768 on 2 busy cores, 256 rows took
# 0.755 of TRL's time where 64 took 1.10; benchmarks/logprob_cost.py).
_PER_TOKEN_ELEMENTS = 1 << 23


def accumulating(tensor: torch.Tensor) -> torch.dtype:
    """Float32 for half, bfloat16 and float32 inputs; float64 kept."""
    return torch.promote_types(tensor.dtype, torch.float32)


def chunk_rows(rows: int, hidden_size: int, local_vocab: int, chunk_size: int | None, per_token: bool) -> int:
    """Rows per chunk: given, or so that a chunk's logits hold no more than the hidden states, or 8 MiB of
    float32 where that is more (32 MiB for per-token results)."""
    budget = max(rows * hidden_size, _PER_TOKEN_ELEMENTS if per_token else _CHUNK_ELEMENTS)
    return chunk_size if chunk_size is not None else max(1, min(rows, budget // max(local_vocab, 1)))


@dataclass(frozen=True)
class Plan:
    """Everything about a call that is not a tensor: the logits' transform, the vocabulary slice (``offset`` of
    ``vocab``, the group of the other slices), rows per chunk, what is computed."""

    logit_scale: float
    softcap: float | None
    temperature: float
    offset: int
    vocab: int
    group: Any
    chunk: int
    ignore_index: int
    entropy: bool = False
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    # per-token statistics without gradient, TRL's fused head's names: log(sum p^2), the logits' mean, whether
    # the target is the first most likely token
    log_sum_sq_probs: bool = False
    mean_logits: bool = False
    is_top1: bool = False

    @property
    def slope(self) -> float:
        """``dz/da`` without a cap; under one, this times ``1 - tanh^2``."""
        return self.logit_scale / self.temperature

    def chunks(self, rows: int) -> list[slice]:
        return [slice(start, start + self.chunk) for start in range(0, rows, self.chunk)]

    def columns(self, rows: int, local_vocab: int) -> list[slice]:
        """Slices of this rank's vocabulary whose logits for all ``rows`` tokens hold as many elements as a chunk
        of rows does over the whole slice (at least one column)."""
        width = max(1, self.chunk * local_vocab // max(rows, 1))
        return [slice(start, start + width) for start in range(0, local_vocab, width)]

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The chunk's transformed logits on this rank's slice, a fresh float32 (float64) buffer."""
        z = (hidden @ weight.t()).to(accumulating(hidden))
        if bias is not None:
            z.add_(bias)
        if self.softcap is None:
            return z.mul_(self.slope) if self.slope != 1.0 else z
        return z.mul_(self.logit_scale / self.softcap).tanh_().mul_(self.softcap / self.temperature)

    def cap_slope(self, z: torch.Tensor) -> torch.Tensor | None:
        """``1 - tanh^2`` of the cap, read off the logits before they are overwritten (a buffer of their size);
        None without a cap."""
        if self.softcap is None:
            return None
        return (z * (self.temperature / self.softcap)).square_().neg_().add_(1.0)


@dataclass
class Rows:
    """Each row's statistics over the whole vocabulary, and this rank's ``exp(z - max)`` (its buffer)."""

    lse: torch.Tensor
    picked: torch.Tensor  # the target's logit
    exps: torch.Tensor
    total: torch.Tensor  # sum of exp(z - max) over the vocabulary
    entropy: torch.Tensor | None = None
    mean: torch.Tensor | None = None  # the logits' mean over the vocabulary
    log_sum_sq: torch.Tensor | None = None  # log(sum p^2)
    top1: torch.Tensor | None = None  # the target's logit is the largest, and no earlier word's is as large


def statistics(z: torch.Tensor, local: torch.Tensor, plan: Plan) -> Rows:
    """One MAX all-reduce of the rows' maxima (and, for ``is_top1``, of the largest logit before the target's
    word), one SUM all-reduce of their sums of exponentials, target logits (only the slice holding the target
    contributes), and, when asked, sums of ``exp(z - max) * (z - max)`` (entropy), of the logits (label smoothing,
    mean logits) and of ``exp(z - max)^2`` (``log_sum_sq_probs``). ``z`` is overwritten: ``exps`` is ``z``
    itself, unless the entropy is asked for (then ``z`` ends as the products)."""
    rows, width = z.shape
    mine = (local >= 0) & (local < width)
    picked = z.gather(1, local.clamp(0, max(width - 1, 0)).unsqueeze(1)).squeeze(1) if width else z.new_zeros(rows)
    sums: dict[str, torch.Tensor] = {"picked": torch.where(mine, picked, 0.0)}
    if plan.label_smoothing or plan.mean_logits:
        sums["logits"] = z.sum(dim=1)
    # a rank holding no vocabulary row (more ranks than rows) contributes -inf
    maxima = [z.max(dim=1).values if width else z.new_full((rows,), -math.inf)]
    if plan.is_top1:  # argmax's first maximum: a word before the target's as large makes it not top-1
        before = torch.arange(width, device=z.device) < local.unsqueeze(1)
        maxima.append(z.masked_fill(~before, -math.inf).amax(dim=1) if width else maxima[0].clone())
    reduced = torch.stack(maxima)
    if plan.group is not None:
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=plan.group)
    largest = reduced[0]
    shifted = z.sub_(largest.unsqueeze(1))
    exps = shifted.exp() if plan.entropy else shifted.exp_()
    if plan.log_sum_sq_probs:
        sums["squares"] = torch.linalg.vecdot(exps, exps)
    if plan.entropy:  # in z's place: nothing reads it after; torch's sum, more accurate than a dot product's
        sums["products"] = shifted.mul_(exps).sum(dim=1)
    names = ["total", *sums]
    stacked = torch.stack([exps.sum(dim=1), *sums.values()])
    if plan.group is not None:
        dist.all_reduce(stacked, group=plan.group)
    summed = dict(zip(names, stacked, strict=True))
    total = summed["total"]
    found = Rows(largest + total.log(), summed["picked"], exps, total)
    if "logits" in summed:
        found.mean = summed["logits"] / plan.vocab
    if plan.entropy:
        found.entropy = total.log() - summed["products"] / total
    if plan.log_sum_sq_probs:
        found.log_sum_sq = summed["squares"].log() - 2 * total.log()
    if plan.is_top1:
        found.top1 = (found.picked >= largest) & (found.picked > reduced[1])
    return found


@dataclass
class Coefficients:
    """Per-row coefficients of the logits' gradient ``p * (alpha + beta * (z - E[z])) - gamma * onehot - delta``
    (None: zero), already times ``dz/da``'s constant part."""

    alpha: torch.Tensor
    gamma: torch.Tensor | None = None
    beta: torch.Tensor | None = None
    delta: torch.Tensor | None = None


def loss_coefficients(weight: torch.Tensor, lse: torch.Tensor, plan: Plan) -> Coefficients:
    """For ``weight`` times each row's loss ``lse - (1 - eps) z[target] - eps mean(z) + z_loss lse^2``: its
    gradient ``p (1 + 2 z_loss lse) - (1 - eps) onehot - eps / V``."""
    weight = weight * plan.slope
    alpha = weight * (1.0 + 2.0 * plan.z_loss * lse) if plan.z_loss else weight
    delta = weight * (plan.label_smoothing / plan.vocab) if plan.label_smoothing else None
    return Coefficients(alpha, weight * (1.0 - plan.label_smoothing), None, delta)


def logits_grad(
    buffer: torch.Tensor, local: torch.Tensor, coefficients: Coefficients, cap: torch.Tensor | None,
    lse: torch.Tensor | None = None, expected: torch.Tensor | None = None, total: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The gradient of the chunk's pre-transform logits ``a``, in ``buffer``'s place. ``buffer`` holds either the
    logits ``z`` (give ``lse``, and ``expected`` = E[z] when ``beta`` is set) or ``exp(z - max)`` (give ``total``,
    its sum over the vocabulary)."""
    c = coefficients
    if total is not None:
        grad = buffer.mul_((c.alpha / total).unsqueeze(1))
    elif c.beta is None:
        grad = buffer.sub_(lse.unsqueeze(1)).exp_().mul_(c.alpha.unsqueeze(1))  # type: ignore[union-attr]
    else:
        softmax = (buffer - lse.unsqueeze(1)).exp_()  # type: ignore[union-attr]
        centred = buffer.sub_(expected.unsqueeze(1))  # type: ignore[union-attr]
        grad = centred.mul_(c.beta.unsqueeze(1)).add_(c.alpha.unsqueeze(1)).mul_(softmax)
    if c.gamma is not None:
        mine = ((local >= 0) & (local < grad.shape[1])).nonzero().squeeze(1)
        grad[mine, local[mine]] -= c.gamma[mine]
    if c.delta is not None:
        grad.sub_(c.delta.unsqueeze(1))
    return grad.mul_(cap) if cap is not None else grad


@dataclass
class Grads:
    """Float32 (float64) gradient accumulators for the inputs that need one (a frozen reference head needs none;
    nothing needs one under ``no_grad``, which ``needs_input_grad`` does not see)."""

    hidden: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None

    @classmethod
    def zeros(cls, needs: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> Grads:
        dtype = accumulating(hidden)
        made = [torch.zeros(t.shape, dtype=dtype, device=t.device) if need and t is not None else None
                for need, t in zip(needs, (hidden, weight, bias), strict=True)]  # fmt: skip
        return cls(*made)

    @property
    def any(self) -> bool:
        return self.hidden is not None or self.weight is not None or self.bias is not None

    def add(self, grad: torch.Tensor, rows: slice, hidden: torch.Tensor, weight: torch.Tensor) -> None:
        """One chunk's gradient of the logits, taken back to the hidden states (its rows), the weight's shard and
        the bias's."""
        if self.hidden is not None:
            self.hidden[rows] = grad.to(weight.dtype) @ weight
        if self.weight is not None:
            self.weight.addmm_(grad.t(), hidden[rows].to(grad.dtype))
        if self.bias is not None:
            self.bias += grad.sum(dim=0)

    def add_columns(self, grad: torch.Tensor, columns: slice, hidden: torch.Tensor, weight: torch.Tensor) -> None:
        """The gradient of every token's logits over some of the vocabulary (``columns``), taken back: added to
        the hidden states' (all rows), written to the weight's and bias's rows of these words, once each."""
        if self.hidden is not None:
            self.hidden += grad.to(weight.dtype) @ weight[columns]
        if self.weight is not None:  # hidden already in the gradient's dtype
            torch.mm(grad.t(), hidden, out=self.weight[columns])
        if self.bias is not None:
            self.bias[columns] = grad.sum(dim=0)

    def finish(self, group: Any) -> Grads:
        """Every rank's part of the hidden states' gradient summed: each slice of the vocabulary contributes."""
        if self.hidden is not None and group is not None:
            dist.all_reduce(self.hidden, group=group)
        return self

    def cast(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> list[Any]:
        return [None if g is None else g.to(t.dtype)  # type: ignore[union-attr]
                for g, t in ((self.hidden, hidden), (self.weight, weight), (self.bias, bias))]  # fmt: skip
