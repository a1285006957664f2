"""An HF ``Trainer`` subclass whose ``compute_loss`` reads ``lm_head.weight`` itself, made exact with ``@routed``.

Run on 2 CPU ranks, no GPU, nothing downloaded (a tiny Llama from a config)::

    python examples/hf_trainer_routed.py           # spawns 2 gloo ranks itself
    torchrun --nproc-per-node 2 examples/hf_trainer_routed.py

Without the decorator the body runs on the unwrapped model and DDP never all-reduces; with it, the body runs
inside DDP's forward and sees the unwrapped model as ``model``.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _hf import GradCheck
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from wrapperroute.decorators import routed


class FusedLossTrainer(Trainer):
    @routed
    def compute_loss(
        self, model: Any, inputs: dict[str, torch.Tensor], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        # Under @routed ``model`` is already the unwrapped LlamaForCausalLM; unwrapping again is harmless, and
        # keeps the body correct if the decorator is removed (it then computes on the unwrapped model).
        inner = self.accelerator.unwrap_model(model)
        hidden = inner.model(input_ids=inputs["input_ids"]).last_hidden_state
        logits = hidden[:, :-1] @ inner.lm_head.weight.t()
        loss = F.cross_entropy(logits.flatten(0, 1).float(), inputs["labels"][:, 1:].flatten())
        return (loss, None) if return_outputs else loss


def main() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)  # fmt: skip
    ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(1)).tolist()
    dataset = [{"input_ids": row, "labels": row} for row in ids]  # the sampler gives each rank other rows
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=2, per_device_train_batch_size=2, use_cpu=True,
                                 ddp_backend="gloo", report_to=[], save_strategy="no", logging_strategy="no",
                                 remove_unused_columns=False, max_grad_norm=0.0)  # fmt: skip
        FusedLossTrainer(LlamaForCausalLM(config), args, train_dataset=dataset, callbacks=[GradCheck()]).train()


if __name__ == "__main__":
    if "RANK" in os.environ and not dist.is_initialized():  # under torchrun: let accelerate set up the group
        main()
    else:
        from wrapperroute.ranks import RankPool

        with RankPool(2) as pool:
            pool.run(main)
