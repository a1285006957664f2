"""TRL's DPO with ``use_liger_kernel=True`` under DDP, fixed by ``patch_trl()``: 2 CPU ranks, nothing downloaded.

TRL 1.10-1.13 compute the Liger DPO/KTO loss on the unwrapped model under plain DDP, so gradients never
all-reduce. ``patch_trl()`` routes that loss through the wrapper (isolated from DDP's graph optimizer, which
cannot compile Liger's torch.func loss). A fork that vendors TRL can instead swap one import::

    # trl/models/utils.py or any trainer:  from ..models.utils import _ForwardRedirection
    from wrapperroute.integrations.trl import ForwardRedirection as _ForwardRedirection

Run::

    python examples/trl_fork_patch.py              # spawns 2 gloo ranks itself; add --unpatched to see the bug
    torchrun --nproc-per-node 2 examples/trl_fork_patch.py
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from _hf import GradCheck
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = [f"w{i}" for i in range(48)]
# Liger's Triton kernels need a GPU; its chunked DPO/KTO losses are pure torch and run on CPU.
NO_TRITON = {"rope": False, "rms_norm": False, "swiglu": False, "cross_entropy": False,
             "fused_linear_cross_entropy": False}  # fmt: skip


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>", "<unk>", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def save_tiny_model(folder: str) -> None:
    """DPO builds its reference model from the policy's path, so the tiny model lives in a folder."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer().save_pretrained(folder)


def preference_rows(rows: int) -> list[dict[str, str]]:
    generator = torch.Generator().manual_seed(0)

    def sentence(length: int) -> str:
        return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (length,), generator=generator).tolist())

    return [{"prompt": sentence(4), "chosen": sentence(3), "rejected": sentence(3)} for _ in range(rows)]


def main(patched: bool = True) -> None:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from wrapperroute.integrations.trl import patch_trl

    if patched:
        report = patch_trl()
        if dist.get_rank() == 0:
            print(f"patch_trl() on TRL {report.version}: {list(report.patched)} {report.note}", flush=True)
    # transformers saves on rank 0 only: share one folder.
    holder: list[Any] = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder)
    folder: str = holder[0]
    if dist.get_rank() == 0:
        save_tiny_model(folder)
    dist.barrier()
    try:
        args = DPOConfig(output_dir=os.path.join(folder, "out"), max_steps=2, per_device_train_batch_size=2,
                         use_cpu=True, ddp_backend="gloo", report_to=[], save_strategy="no",
                         logging_strategy="no", max_grad_norm=0.0, use_liger_kernel=True,
                         liger_kernel_config=NO_TRITON)  # fmt: skip
        trainer = DPOTrainer(model=folder, args=args, train_dataset=Dataset.from_list(preference_rows(16)),
                             processing_class=tokenizer(), callbacks=[GradCheck()])  # fmt: skip
        trainer.train()
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    patched = "--unpatched" not in sys.argv
    if "RANK" in os.environ and not dist.is_initialized():  # under torchrun
        dist.init_process_group("gloo")
        main(patched)
    else:
        from wrapperroute.ranks import RankPool

        with RankPool(2) as pool:
            pool.run(main, patched, timeout=240)
