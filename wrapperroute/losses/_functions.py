"""The two autograd functions: per-token results (log-probabilities with the entropy, or each token's loss) that
keep a few floats per token and recompute the logits in the backward, a slice of the vocabulary at a time; and a
mean or summed cross-entropy whose gradients are taken chunk by chunk in the forward."""

from __future__ import annotations

from typing import Any

import torch

from ._rows import Coefficients, Grads, Plan, accumulating, logits_grad, loss_coefficients, statistics


class PerToken(torch.autograd.Function):
    """``log p(target)`` per token, or, when ``kind`` is ``"loss"``, each token's cross-entropy with label
    smoothing and z-loss; always five outputs: that, then the entropy (``plan.entropy``, differentiable), then
    ``log(sum p^2)``, the logits' mean and whether the target is the first most likely word (each when the plan
    asks for it, without gradient), None where not asked. Ignored tokens give 0 (False) and no gradient. Keeps
    each row's log-sum-exp (and ``E[z]`` for the entropy); the backward recomputes the logits, since the
    gradients flowing in are only known then, a slice of the vocabulary for every token at a time (as many
    logits as a chunk of tokens), and skips the entropy's terms when its gradient is None (the entropy unused,
    or only logged)."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
        plan: Plan, kind: str,
    ) -> Any:  # fmt: skip
        ctx.set_materialize_grads(False)
        dtype = accumulating(hidden)
        keep = target != plan.ignore_index
        local = target - plan.offset
        wide_bias = None if bias is None else bias.to(dtype)
        value, lses = (torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device) for _ in range(2))
        entropy = torch.empty_like(value) if plan.entropy else None
        log_sum_sq = torch.empty_like(value) if plan.log_sum_sq_probs else None
        mean = torch.empty_like(value) if plan.mean_logits else None
        top1 = torch.empty(value.shape, dtype=torch.bool, device=value.device) if plan.is_top1 else None
        for rows in plan.chunks(hidden.shape[0]):
            found = statistics(plan.logits(hidden[rows], weight, wide_bias), local[rows], plan)
            lses[rows] = found.lse
            if kind == "loss":
                smoothed = found.picked if found.mean is None else torch.lerp(found.picked, found.mean,
                                                                              plan.label_smoothing)  # fmt: skip
                value[rows] = found.lse - smoothed + plan.z_loss * found.lse.square()
            else:
                value[rows] = found.picked - found.lse
            for kept, computed in ((entropy, found.entropy), (log_sum_sq, found.log_sum_sq), (mean, found.mean),
                                   (top1, found.top1)):  # fmt: skip
                if kept is not None and computed is not None:
                    kept[rows] = computed
        value = torch.where(keep, value, 0.0)
        expected = None
        if entropy is not None:
            entropy = torch.where(keep, entropy, 0.0)
            expected = lses - entropy
        ctx.save_for_backward(hidden, weight, bias, target, lses, expected)
        ctx.plan, ctx.kind = plan, kind
        extras = [None if t is None else t.masked_fill_(~keep, 0) for t in (log_sum_sq, mean, top1)]
        ctx.mark_non_differentiable(*(t for t in extras if t is not None))
        return value, entropy, *extras

    @staticmethod
    def backward(ctx: Any, grad_value: torch.Tensor | None, grad_entropy: torch.Tensor | None = None, *_: Any) -> Any:
        hidden, weight, bias, target, lses, expected = ctx.saved_tensors
        plan: Plan = ctx.plan
        if not any(ctx.needs_input_grad[:3]) or (grad_value is None and grad_entropy is None):
            return None, None, None, None, None, None
        grads = Grads.zeros(ctx.needs_input_grad[:3], hidden, weight, bias)
        dtype = accumulating(hidden)
        # ignored tokens get no gradient, whatever flows in
        keep = (target != plan.ignore_index).to(dtype)
        incoming = None if grad_value is None else grad_value.to(dtype) * keep
        if ctx.kind == "loss":
            assert incoming is not None  # the only output
            coefficients = loss_coefficients(incoming, lses, plan)
        else:  # d log p / dz = onehot - p; d H / dz = -p (z - E[z])
            minus = torch.zeros_like(keep) if incoming is None else incoming * -plan.slope
            beta = None if grad_entropy is None else grad_entropy.to(dtype) * keep * -plan.slope
            coefficients = Coefficients(minus, None if incoming is None else minus, beta)
        local = target - plan.offset
        wide_bias = None if bias is None else bias.to(dtype)
        # over the vocabulary, every token at once: each word's gradient row written once, where chunks of tokens
        # would each add to the whole weight's gradient (a pass over it per chunk)
        widened = hidden.to(dtype) if grads.weight is not None else hidden
        for columns in plan.columns(hidden.shape[0], weight.shape[0]):
            z = plan.logits(hidden, weight[columns], None if wide_bias is None else wide_bias[columns])
            grad = logits_grad(z, local - columns.start, coefficients, plan.cap_slope(z), lse=lses,
                               expected=expected)  # fmt: skip
            grads.add_columns(grad, columns, widened, weight)
        return (*grads.finish(plan.group).cast(hidden, weight, bias), None, None, None)


class Summed(torch.autograd.Function):
    """Mean or summed cross-entropy (label smoothing, z-loss) whose gradients are computed chunk by chunk in the
    forward (the incoming gradient is one number, known only in the backward, which scales them): each chunk's
    logits are freed as soon as its gradients are taken."""

    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
        plan: Plan, mean: bool, grad_enabled: bool,
    ) -> torch.Tensor:  # fmt: skip
        keep = target != plan.ignore_index
        dtype = accumulating(hidden)
        count = keep.sum().to(dtype)
        # no token kept: the loss is NaN (0/0, as torch's) and the gradients 0 (as torch's), not 0 * inf
        scale = 1.0 / count.clamp_min(1) if mean else torch.ones((), dtype=dtype, device=hidden.device)
        grads = Grads.zeros([need and grad_enabled for need in ctx.needs_input_grad[:3]], hidden, weight, bias)
        total = torch.zeros((), dtype=dtype, device=hidden.device)
        local = target - plan.offset
        wide_bias = None if bias is None else bias.to(dtype)
        for rows in plan.chunks(hidden.shape[0]):
            z = plan.logits(hidden[rows], weight, wide_bias)
            cap = plan.cap_slope(z) if grads.any else None
            found = statistics(z, local[rows], plan)
            kept = keep[rows]
            smoothed = found.picked if found.mean is None else torch.lerp(found.picked, found.mean,
                                                                          plan.label_smoothing)  # fmt: skip
            total += torch.where(kept, found.lse - smoothed + plan.z_loss * found.lse.square(), 0.0).sum()
            if grads.any:
                coefficients = loss_coefficients(kept * scale, found.lse, plan)
                grads.add(logits_grad(found.exps, local[rows], coefficients, cap, total=found.total), rows, hidden,
                          weight)  # fmt: skip
        grads.finish(plan.group)
        ctx.save_for_backward(grads.hidden, grads.weight, grads.bias)
        ctx.dtypes = tuple(None if t is None else t.dtype for t in (hidden, weight, bias))
        return total / count if mean else total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        saved = ctx.saved_tensors
        # the common incoming gradient, 1: the gradients as they are, no copy of the weight's (one number read)
        one = grad_out.numel() == 1 and float(grad_out) == 1.0
        scaled = [None if g is None else (g if one else g * grad_out).to(d) for g, d in zip(saved, ctx.dtypes,
                                                                                          strict=True)]  # fmt: skip
        return (*scaled, None, None, None, None)
