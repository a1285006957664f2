"""The MoE load-balancing term a fused loss can leave out, said loudly. Never imports TRL.

A mixture-of-experts model whose config asks for router logits (``output_router_logits``, a non-zero
``router_aux_loss_coef``) adds ``router_aux_loss_coef * load_balancing_loss_func(router_logits, ...)`` to its loss
in its own forward. A loss computed from the backbone's hidden states (a fused LM head or chunked loss that reads
the head's weight) has the term only where the code computing it adds it. Whether it does is read from that
code: the module defining it names the term (``aux_loss``) or never does. TRL 1.12's DPO, KTO, GRPO and SFT add
it or refuse a Liger loss with it; its distillation trainers (GKD, GOLD, the distillation trainer, ...) never
add it, and GKD inherits SFT's default that turns router logits on for every MoE model.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from typing import Any

from torch import nn

# What TRL's code names the term wherever it adds it (``aux_loss``, ``router_aux_loss_coef``).
_TERM = "aux_loss"
# module name -> whether its source names the term
_adds_term: dict[str, bool] = {}
# classes already warned about: once per class, not per step
_warned: set[type] = set()


def warn_if_router_loss_dropped(owner: Any, model: nn.Module, module_name: str) -> None:
    """Warn, once per class of ``owner``, where ``model`` (unwrapped) asks for the MoE load-balancing term and the
    module ``module_name``, where ``owner`` computes its loss from the backbone's hidden states, never adds it."""
    cls = type(owner)
    if cls in _warned:
        return
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    coefficient = getattr(text, "router_aux_loss_coef", 0.0) or 0.0
    if not getattr(text, "output_router_logits", False) or not coefficient or _names_term(module_name):
        return
    _warned.add(cls)
    warnings.warn(
        f"wrapperroute: {cls.__name__} computes its loss from the backbone's hidden states, and the installed "
        f"{module_name} never adds the MoE load-balancing term that {type(text).__name__} asks for "
        f"(output_router_logits=True, router_aux_loss_coef={coefficient}): this loss lacks the term the model's own "
        "forward adds. To train without it knowingly, set router_aux_loss_coef=0.0 in the trainer's config where it "
        "has one (TRL's SFT-based trainers copy it into the model's config) or output_router_logits=False on the "
        "model's config; or add the term to the loss (transformers' load_balancing_loss_func on the router logits).",
        UserWarning,
        stacklevel=3,
    )


def _names_term(module_name: str) -> bool:
    known = _adds_term.get(module_name)
    if known is None:
        module = sys.modules.get(module_name)
        try:
            known = module is not None and _TERM in inspect.getsource(module)
        except (OSError, TypeError):  # no source to read: the term cannot be found, so it is said to be missing
            known = False
        _adds_term[module_name] = known
    return known
