"""The independent truth for wrapperroute.losses' options: the logits materialised in float64 by the formula
(``z = (hidden @ W.T + bias) * logit_scale``, capped ``softcap * tanh(z / softcap)``, over ``temperature``) and
torch's own ``log_softmax`` and ``F.cross_entropy`` on them; the cases every test draws from; and the call of
ours for a case. Shared by the one-process tests and the rank bodies."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from wrapperroute.losses import linear_cross_entropy, linear_logprobs


@dataclass(frozen=True)
class Case:
    temperature: float = 1.0
    softcap: float | None = None
    logit_scale: float = 1.0
    bias: bool = False
    entropy: bool = False
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    ignore_index: int = -100
    reduction: str = "mean"
    chunk_size: int | None = None
    float32: bool = False
    statistics: bool = False  # TRL's fields without gradient: log_sum_sq_probs, mean_logits, is_top1

    @property
    def tolerance(self) -> float:
        return 1e-5 if self.float32 else 1e-9


# Each option alone, then all of them together under each reduction and chunk size, in float64 and float32.
ALONE = [Case(), Case(temperature=0.7), Case(softcap=2.0), Case(logit_scale=1.7), Case(bias=True),
         Case(entropy=True), Case(statistics=True), Case(label_smoothing=0.1), Case(z_loss=1e-2), Case(ignore_index=3),
         Case(reduction="sum"), Case(reduction="none"), Case(chunk_size=1), Case(chunk_size=5)]  # fmt: skip
EVERY = Case(temperature=0.7, softcap=2.0, logit_scale=1.7, bias=True, entropy=True, label_smoothing=0.1,
             z_loss=1e-2, ignore_index=3, statistics=True)  # fmt: skip
COMBINED = [dataclasses.replace(EVERY, reduction=r, chunk_size=c, float32=f)
            for r in ("mean", "sum", "none") for c in (None, 5) for f in (False, True)]  # fmt: skip
CASES = ALONE + [dataclasses.replace(case, float32=True) for case in ALONE] + COMBINED


def inputs(case: Case, rows: int, hidden_size: int, vocab: int, seed: int) -> dict[str, Any]:
    """Hidden states, head, bias (or None) and targets, the same for a seed; a few targets ignored."""
    generator = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if case.float32 else torch.float64
    hidden = torch.randn(rows, hidden_size, generator=generator, dtype=dtype)
    weight = torch.randn(vocab, hidden_size, generator=generator, dtype=dtype) * 0.5
    bias = torch.randn(vocab, generator=generator, dtype=dtype) if case.bias else None
    target = torch.randint(0, vocab, (rows,), generator=generator)
    if case.statistics:  # the premise of is_top1: some targets are the most likely word, most are not
        target[1::2] = logits(case, hidden, weight, bias)[1::2].argmax(dim=-1)
    target[:: max(1, rows // 3)] = case.ignore_index
    incoming = torch.randn(rows, generator=generator, dtype=torch.float64)
    return {"hidden": hidden, "weight": weight, "bias": bias, "target": target, "incoming": incoming,
            "entropy_incoming": torch.randn(rows, generator=generator, dtype=torch.float64),
            "loss_incoming": torch.randn(rows, generator=generator, dtype=torch.float64)}  # fmt: skip


def logits(case: Case, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    z = hidden @ weight.t() + (bias if bias is not None else 0.0)
    z = z * case.logit_scale
    if case.softcap is not None:
        z = case.softcap * torch.tanh(z / case.softcap)
    return z / case.temperature


def truth(case: Case, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          target: torch.Tensor) -> dict[str, torch.Tensor]:  # fmt: skip
    """Log-probabilities, the entropy (when the case asks for it) and the cross-entropy (with its z-loss), from
    float64 logits materialised."""
    z = logits(case, hidden.double(), weight.double(), None if bias is None else bias.double())
    keep = target != case.ignore_index
    log_p = torch.log_softmax(z, dim=-1)
    picked = log_p.gather(1, torch.where(keep, target, 0).unsqueeze(1)).squeeze(1)
    found = {"logprobs": torch.where(keep, picked, 0.0)}
    if case.entropy:
        found["entropy"] = torch.where(keep, -(log_p.exp() * log_p).sum(-1), 0.0)
    if case.statistics:  # no gradient: TRL's fields are logged or weigh, never differentiated
        found["log_sum_sq_probs"] = torch.where(keep, torch.logsumexp(2 * log_p, dim=-1), 0.0).detach()
        found["mean_logits"] = torch.where(keep, z.mean(dim=-1), 0.0).detach()
        found["is_top1"] = (keep & (z.argmax(dim=-1) == target)).double()
    ce = F.cross_entropy(z, target, ignore_index=case.ignore_index, label_smoothing=case.label_smoothing,
                         reduction=case.reduction)  # fmt: skip
    squares = torch.where(keep, torch.logsumexp(z, dim=-1).square(), 0.0) * case.z_loss
    reduced = {"none": squares, "sum": squares.sum(), "mean": squares.sum() / keep.sum()}[case.reduction]
    found["cross_entropy"] = ce + reduced
    return found


def ours(case: Case, hidden: Any, weight: Any, bias: Any, target: Any) -> dict[str, Any]:
    """wrapperroute.losses on the case, the same keys as :func:`truth`."""
    options = {"bias": bias, "temperature": case.temperature, "softcap": case.softcap, "chunk_size": case.chunk_size,
               "logit_scale": case.logit_scale, "ignore_index": case.ignore_index}  # fmt: skip
    found: dict[str, Any] = {}
    if case.statistics:
        fields = ("entropy",) * case.entropy + ("log_sum_sq_probs", "mean_logits", "is_top1")
        given = linear_logprobs(hidden, weight, target, outputs=fields, **options)
        found["logprobs"] = given.pop("log_probs")
        found.update(given)
        found["is_top1"] = found["is_top1"].to(found["logprobs"].dtype)
    elif case.entropy:
        found["logprobs"], found["entropy"] = linear_logprobs(hidden, weight, target, return_entropy=True, **options)
    else:
        found["logprobs"] = linear_logprobs(hidden, weight, target, **options)
    found["cross_entropy"] = linear_cross_entropy(hidden, weight, target, label_smoothing=case.label_smoothing,
                                                  z_loss=case.z_loss, reduction=case.reduction, **options)  # type: ignore[arg-type]  # fmt: skip
    return found


def objective(found: dict[str, torch.Tensor], made: dict[str, Any], rows: slice | None = None) -> torch.Tensor:
    """One number whose gradient takes every output's, each per-token output weighed by its own random incoming
    gradient (``rows``: the rows these per-token outputs hold; without smoothing, ``-logprobs`` is the
    cross-entropy and the same weights would cancel)."""
    total = torch.zeros((), dtype=torch.float64)
    for name, value in found.items():
        weights = made[{"logprobs": "incoming", "entropy": "entropy_incoming"}.get(name, "loss_incoming")]
        if value.dim():
            total = total + (value.double() * weights[rows if rows is not None else slice(None)]).sum()
        else:
            total = total + value.double() * weights[0]
    return total
