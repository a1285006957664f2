"""TRL's fused LM head in the model (``trl.trainer.utils.add_fused_lm_head``) where its head is sharded. Never
imports TRL.

``model(..., fused_lm_head=True)`` runs the backbone, then reads the head's weight directly, never calling the
head, and gathers a ``DTensor`` head with ``full_tensor()``:

- a head in an FSDP2 unit of its own is unsharded only by that unit's forward: read outside it, its gradient
  comes back through DTensor's redistribution instead of FSDP2's reduce-scatter (consistent across ranks, and
  wrong). :func:`head_unit` finds that unit; the fused forward then runs inside its forward, FSDP2's hooks only
  (``adapters.fsdp2.own_hooks_only``).
- a head split on the vocabulary over tensor-parallel ranks is exact, but the whole vocabulary is gathered on
  every rank at every call. :func:`vocab_parallel_forward` computes the same output from the shard as it is
  (:func:`wrapperroute.losses.linear_logprobs`), with the settings TRL's installer gave this model, read from
  the forward it installed (:func:`installed_settings`), not from a copy of how TRL reads a config.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .._head import output_embedding
from ..adapters.fsdp2 import is_sharded_param
from ..detect import detect
from ..losses import linear_logprobs

# The values TRL's fused forward closes over and this module reads: the installer's arguments and what it read
# off the model's config once (TRL 1.16's names).
SETTINGS = ("temperature", "cast_lm_head_to_fp32", "outputs", "final_logit_softcapping", "logit_scale",
            "backbone_attr", "text_config")  # fmt: skip


def installed_settings(forward: Callable[..., Any]) -> dict[str, Any] | None:
    """The settings TRL's ``add_fused_lm_head`` installed ``forward`` with (its closure's values by name), or
    None where any of :data:`SETTINGS` is not there (a release that computes them otherwise)."""
    function = getattr(forward, "__func__", forward)
    code, cells = getattr(function, "__code__", None), getattr(function, "__closure__", None) or ()
    values: dict[str, Any] = {}
    for name, cell in zip(getattr(code, "co_freevars", ()), cells, strict=False):
        with contextlib.suppress(ValueError):  # a cell not yet filled
            values[name] = cell.cell_contents
    return values if all(name in values for name in SETTINGS) else None


def head_unit(model: nn.Module) -> nn.Module | None:
    """The FSDP2 unit of ``model``'s output embedding, when the head is one (alone, or grouped with others): only
    its own forward unshards the head. None for a head in the root's group, or under any other wrapper."""
    head = output_embedding(model)
    if head is None or head is model:
        return None
    found = detect(head)
    return head if found.kind in ("fsdp2", "replicate_fsdp") and found.wrapper is head else None


def vocab_sharded(weight: Any) -> bool:
    """Whether a head's weight is split on the vocabulary over tensor-parallel ranks: a ``DTensor`` sharded on
    dimension 0 that is not FSDP2's own shard of it (what a loss outside the unit's forward would see)."""
    placements = getattr(weight, "placements", None)
    if not placements or is_sharded_param(weight):
        return False
    return any(placement.is_shard(0) for placement in placements)


def vocab_parallel_forward(
    model: nn.Module, output_class: Any, settings: dict[str, Any], *args: Any, labels: Any = None,
    shift_labels: Any = None, num_items_in_batch: Any = None, **kwargs: Any,
) -> Any:  # fmt: skip
    """TRL's fused forward (``fused_lm_head=True``) on a vocabulary-sharded head, nothing of its size gathered.

    As TRL's: the backbone without its cache (router logits where the config asks for them), the labels shifted
    (or ``shift_labels`` as they are), every per-token field of ``settings["outputs"]`` over the tokens whose
    label is not -100 (0 elsewhere), computed in the dtype TRL computes in (autocast's, or the hidden states';
    float32 with ``cast_lm_head_to_fp32``), the loss summed over ``num_items_in_batch`` (else the valid tokens),
    plus the MoE load-balancing term where the config asks for it. ``output_class``: TRL's
    ``FusedCausalLMOutput``, given the fields it has."""
    text_config = settings["text_config"]
    kwargs["use_cache"] = False
    if getattr(text_config, "output_router_logits", False):
        kwargs.setdefault("output_router_logits", True)
    backbone = getattr(model, settings["backbone_attr"])(*args, **kwargs)
    hidden = backbone.last_hidden_state
    if shift_labels is None:
        hidden, labels = hidden[:, :-1], labels[:, 1:]
    else:
        labels = shift_labels
    head: Any = output_embedding(model)
    weight, bias = head.weight, head.bias
    labels = labels.to(hidden.device)
    mask = labels != -100
    device = hidden.device.type
    autocast: Any = contextlib.nullcontext()
    if settings["cast_lm_head_to_fp32"]:
        compute = torch.float32
        autocast = torch.autocast(device, enabled=False)
    else:
        compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    with autocast:
        fields = linear_logprobs(
            hidden.reshape(-1, hidden.shape[-1]).to(compute), weight.to(compute), labels.reshape(-1),
            bias=None if bias is None else bias.to(compute), temperature=settings["temperature"],
            softcap=settings["final_logit_softcapping"], logit_scale=settings["logit_scale"],
            outputs=tuple(name for name in settings["outputs"] if name != "log_probs"),
        )  # fmt: skip
    per_token = {name: value.view(mask.shape) for name, value in fields.items()}
    loss = -per_token["log_probs"].sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None
                                            else num_items_in_batch)  # fmt: skip
    aux_loss = None
    if kwargs.get("output_router_logits"):
        aux_loss = _load_balancing(model, text_config, backbone.router_logits, kwargs.get("attention_mask"))
        loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
    given = {"loss": loss, **per_token, "label_mask": mask, "aux_loss": aux_loss}
    known = {field.name for field in dataclasses.fields(output_class)}
    return output_class(**{name: value for name, value in given.items() if name in known})


def _load_balancing(model: nn.Module, text_config: Any, router_logits: Any, attention_mask: Any) -> Any:
    """The MoE load-balancing loss a family's own forward adds (Mixtral's, which every family pulls in), over
    the experts the model counts (its own attribute, else its config's)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    experts = getattr(model, "num_experts", None) or text_config.num_experts
    per_token = getattr(model, "num_experts_per_tok", None) or text_config.num_experts_per_tok
    return load_balancing_loss_func(router_logits, experts, per_token, attention_mask)
