"""Rank bodies for tests/test_trl.py: our ``ForwardRedirection`` and TRL's under DDP (module level: the pool
pickles them by reference). Real TRL trainer steps run ``wrapperroute.check.trl_cells.trl_step``, shared with
``check --trl``.

Gradient truth is the upstream measurement: after one training step, every parameter's gradient is compared
across ranks (one all-gather, ``ranklib.measure``) and asserted there; the ranks see different data.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from ranklib import measure, shifted_fused_ce
from torch.nn.parallel import DistributedDataParallel as DDP

from wrapperroute.check.models import TinyConfig, build_model
from wrapperroute.check.trl_layouts import whole_grads


def forward_redirection_ddp(use_trl: bool) -> None:
    """Our ForwardRedirection (or TRL's) under DDP on the fused loss: gradients synced (bit-equal, ours), and
    ours restores the forward, where TRL's leaves an instance forward behind."""
    redirection_class: Any
    if use_trl:
        from trl.models.utils import _ForwardRedirection as redirection_class
    else:
        from wrapperroute.integrations.trl import ForwardRedirection as redirection_class

    config = TinyConfig()
    ids = torch.randint(0, config.vocab, (2, config.seq), generator=torch.Generator().manual_seed(dist.get_rank()))
    model = build_model(config)
    ddp = DDP(model)
    loss = redirection_class()(ddp, model, shifted_fused_ce, model, ids)
    loss.backward()
    cell = measure(whole_grads(model))
    whose = "TRL's" if use_trl else "ours"
    assert cell["differ"] == 0, f"{whose}: gradients differ across ranks: {cell}"
    left = "forward" in model.__dict__
    if use_trl:
        assert left, "TRL's redirection no longer leaves an instance forward: the comparison is stale"
    else:
        assert cell["max_diff"] == 0.0, f"ours: gradients not bit-equal across ranks: {cell}"
        assert not left, "ours left an instance forward on the model"


def moe_distillation_step(router_logits: bool) -> dict[str, Any]:
    """One patched step of TRL's distillation trainer with ``use_liger_kernel=True`` (where its config has it) on a
    tiny Mixtral student and teacher under DDP (accelerate's, on these ranks), asking for router logits (TRL's
    default coefficient) or not (``output_router_logits=False`` on the models' configs and, where the trainer's
    config has it, ``router_aux_loss_coef=0.0``). Its loss reads the backbone's hidden states: through a Liger
    loss in ``compute_loss`` (TRL 1.10-1.12) or its own chunked loss through TRL's redirection (TRL 1.16). Returns
    wrapperroute's warnings and the model's own load-balancing term on a batch (what its own forward adds to the
    loss: non-zero, or the warning is moot)."""
    import tempfile
    import warnings

    from datasets import Dataset
    from transformers import MixtralConfig, MixtralForCausalLM

    from wrapperroute.check import trl_cells as cells
    from wrapperroute.integrations import _router_loss
    from wrapperroute.integrations import trl as integration

    def tiny_moe() -> Any:
        torch.manual_seed(0)
        config = MixtralConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
            output_router_logits=router_logits, router_aux_loss_coef=0.5, pad_token_id=0, bos_token_id=1,
            eos_token_id=2,
        )  # fmt: skip
        return MixtralForCausalLM(config)

    ids = torch.randint(3, 52, (2, 8), generator=torch.Generator().manual_seed(0))
    own = tiny_moe()
    own.config.output_router_logits = True
    aux = float(own(ids, labels=ids).aux_loss)
    found = cells.trainer_classes("distill")
    assert found is not None, "this TRL has no DistillationTrainer"
    config_cls, trainer_cls = found
    integration.unpatch_trl()
    integration.patch_trl()
    _router_loss._warned.clear()
    rows = [prompt | chat for prompt, chat in zip(cells._prompt_rows(8), cells._chat_rows(8), strict=True)]
    try:
        with tempfile.TemporaryDirectory() as out, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            args = cells.training_args(config_cls, out, use_liger_kernel=True, liger_kernel_config=cells.NO_TRITON,
                                 remove_unused_columns=False, top_k=1, max_completion_length=4,
                                 **({} if router_logits else {"router_aux_loss_coef": 0.0}))  # fmt: skip
            data = Dataset.from_list(rows)
            trainer = trainer_cls(model=tiny_moe(), teacher_model=tiny_moe(), args=args, train_dataset=data,
                                  processing_class=cells.tokenizer())  # fmt: skip
            trainer.train()
            trainer.train()  # a second run of the same trainer: warned once, not per step
    finally:
        integration.unpatch_trl()
    ours = [str(w.message) for w in caught if str(w.message).startswith("wrapperroute:")]
    return {"warnings": ours, "aux": aux, "wrapper": type(trainer.model_wrapped).__name__}
