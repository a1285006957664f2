"""Real trainers as their users run them: ``--trainer hf`` (an HF ``Trainer`` whose ``compute_loss`` reads
``lm_head.weight`` itself; ``--fix`` decorates it with ``@routed``) or ``--trainer dpo`` (TRL's DPOTrainer
with ``use_liger_kernel=True``; ``--fix`` calls ``patch_trl()`` first). A tiny Llama, built locally. At the end,
rank 0 prints how many parameters differ across the ranks, measured by gathering them: the truth."""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.nn.functional as F


def fused_compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # type: ignore[no-untyped-def]
    inner = self.accelerator.unwrap_model(model)
    hidden = inner.model(input_ids=inputs["input_ids"]).last_hidden_state
    logits = hidden[:, :-1] @ inner.lm_head.weight.t()
    loss = F.cross_entropy(logits.flatten(0, 1).float(), inputs["labels"][:, 1:].flatten())
    return (loss, None) if return_outputs else loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", choices=["hf", "dpo"], required=True)
    parser.add_argument("--fix", action="store_true")
    parser.add_argument("--folder", required=True, help="an empty folder the tiny model is saved to")
    args = parser.parse_args()
    from accelerate import PartialState
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from wrapperroute.check import trl_cells

    PartialState()  # the process group, from the launcher's environment
    # On CPU ranks accelerate's state says DistributedType.NO and every rank is its "main process", with a
    # wait_for_everyone() that waits for nobody: rank 0 saves, every rank waits at the group's own barrier.
    if torch.distributed.get_rank() == 0 and not os.listdir(args.folder):
        vocab, hidden = (64, 16) if args.trainer == "hf" else (trl_cells.LIGER_VOCAB, trl_cells.LIGER_HIDDEN)
        trl_cells.tiny_llama(vocab, hidden).save_pretrained(args.folder)
        trl_cells.tokenizer().save_pretrained(args.folder)
    torch.distributed.barrier()
    model = AutoModelForCausalLM.from_pretrained(args.folder)
    with tempfile.TemporaryDirectory() as out:
        if args.trainer == "hf":
            from transformers import Trainer, TrainingArguments

            from wrapperroute import routed

            class FusedLossTrainer(Trainer):
                compute_loss = routed(fused_compute_loss) if args.fix else fused_compute_loss

            rows = [{"input_ids": r, "labels": r} for r in trl_cells.lm_rows(8, 8)]
            trainer = FusedLossTrainer(
                model=model,
                args=trl_cells.training_args(TrainingArguments, out, remove_unused_columns=False),
                train_dataset=Dataset.from_list(rows),
            )
        else:
            from trl import DPOConfig, DPOTrainer

            if args.fix:
                from wrapperroute.integrations.trl import patch_trl

                patch_trl()
            common = {"use_liger_kernel": True, "liger_kernel_config": trl_cells.NO_TRITON,
                      "remove_unused_columns": False}  # fmt: skip
            trainer = DPOTrainer(
                model=model,
                args=trl_cells.training_args(DPOConfig, out, **common),
                train_dataset=Dataset.from_list(trl_cells.preference_rows(8)),
                processing_class=trl_cells.tokenizer(),
            )
        trainer.train()
    # the truth the audit is held against: how many parameters differ across the ranks after training
    differing = 0
    for param in model.parameters():
        local = param.detach().contiguous()
        everyone = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(everyone, local)
        differing += any(not torch.equal(other, everyone[0]) for other in everyone[1:])
    if torch.distributed.get_rank() == 0:
        print(f"truth: {differing} parameter(s) differ across ranks", flush=True)


if __name__ == "__main__":
    main()
