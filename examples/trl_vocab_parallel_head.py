"""TRL's fused LM head (TRL >= 1.16) on a head sharded on the vocabulary, with nothing of the head's size gathered.

TRL's GRPO, RLOO, DPO, KTO and SFT trainers patch their model's forward with ``trl.trainer.utils.add_fused_lm_head``:
called with ``fused_lm_head=True`` it runs the backbone and returns per-token log-probabilities (and the entropy)
from TRL's ``ChunkedLogProbFunction``. On a ``DTensor`` head (tensor parallelism, FSDP2) it first calls
``weight.full_tensor()``: the whole vocabulary on every rank. ``vocab_parallel_fused_head(model)``, called once
the trainer is built (it patched the model in its ``__init__``), replaces that forward with one that returns the
same ``FusedCausalLMOutput`` from ``wrapperroute.losses.linear_logprobs`` on the shard as it is. Without
``fused_lm_head`` the call goes to TRL's forward, so generation is unchanged::

    trainer = GRPOTrainer(model=model, args=args, ...)
    vocab_parallel_fused_head(trainer.model, temperature=args.temperature)
    if trainer.ref_model is not None:
        vocab_parallel_fused_head(trainer.ref_model, temperature=args.temperature)

What it leaves out of TRL's forward: the MoE load-balancing loss (``output_router_logits``), the fields
``log_sum_sq_probs``, ``mean_logits`` and ``is_top1``, PEFT's prompt-learning labels, and TRL's reading of a
family's own logit multiplier (pass ``logit_scale``; the softcap is read from the config, as TRL does).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from wrapperroute.losses import linear_logprobs


def vocab_parallel_fused_head(model: nn.Module, temperature: float = 1.0, logit_scale: float = 1.0,
                              entropy: bool = True) -> None:  # fmt: skip
    """Replace the ``fused_lm_head=True`` path of ``model.forward`` (TRL's ``add_fused_lm_head``) by one that reads
    the head's shard as it is; ``entropy``: compute it (TRL's ``outputs=("log_probs", "entropy")``)."""
    from trl.trainer.utils import FusedCausalLMOutput

    trl_forward = model.forward
    softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)  # type: ignore[operator]

    def forward(*args: Any, fused_lm_head: bool = False, labels: Any = None, shift_labels: Any = None,
                num_items_in_batch: Any = None, **kwargs: Any) -> Any:  # fmt: skip
        if not fused_lm_head:
            return trl_forward(*args, labels=labels, shift_labels=shift_labels, num_items_in_batch=num_items_in_batch,
                               **kwargs)  # fmt: skip
        kwargs["use_cache"] = False
        hidden = model.base_model(*args, **kwargs).last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        head = model.get_output_embeddings()  # type: ignore[operator]
        found = linear_logprobs(hidden.flatten(0, 1), head.weight, labels.flatten(), bias=head.bias,
                                temperature=temperature, softcap=softcap, logit_scale=logit_scale,
                                return_entropy=entropy)  # fmt: skip
        log_probs, per_token_entropy = found if entropy else (found, None)
        mask = labels != -100
        divisor = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(
            loss=-log_probs.sum() / divisor,
            log_probs=log_probs.view(labels.shape),
            entropy=None if per_token_entropy is None else per_token_entropy.view(labels.shape),
            label_mask=mask,
        )

    model.forward = forward  # type: ignore[method-assign]
