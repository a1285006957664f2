"""Rank-side checks for ``@routed``, HF ``Trainer`` and real TRL trainers: module-level so the pool can pickle
them by reference. Everything is built locally (a tiny Llama from a config, a WordLevel tokenizer): nothing is
downloaded.

Gradient truth is the seed's measurement: after one training step, every parameter's gradient is compared
across ranks (one all-gather, ``_compare_across_ranks``; for real TRL trainers the ranks return their
gradients and the test compares them, so nothing collective runs after training); the ranks see different
data.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from wrapperroute.check.cell import _compare_across_ranks
from wrapperroute.check.models import TinyConfig, build_model
from wrapperroute.decorators import routed
from wrapperroute.route import _isolated_losses

WORDS = [f"w{i}" for i in range(48)]
# The DPO crash needs the Liger loss's two requires-grad heads (policy, unfrozen reference) to span >= 2 DDP
# buckets (the first is 1 MB): 8192 x 64 float32 = 2 MB each. mechanisms.md, "TRL versions".
LIGER_VOCAB, LIGER_HIDDEN = 8192, 64
NO_TRITON = {"rope": False, "rms_norm": False, "swiglu": False, "cross_entropy": False,
             "fused_linear_cross_entropy": False}  # fmt: skip


def _rank() -> int:
    return dist.get_rank()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone().float()
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def _measure(grads: dict[str, torch.Tensor]) -> dict[str, Any]:
    differ, worst = _compare_across_ranks(grads)
    return {"params": len(grads), "differ": differ, "max_diff": worst}


# --- @routed on plain functions and methods, DDP over the embedded tiny LM ----------------------------------


def _fused_ce(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """Reads ``lm_head.weight`` directly: the pattern that skips the wrapper."""
    logits = model(ids) @ model.lm_head.weight.t()
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


routed_fused_ce = routed(_fused_ce)


class _Loop:
    """A trainer-shaped object: ``compute_loss(self, model, inputs)``."""

    @routed
    def compute_loss(self, model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return _fused_ce(model, inputs["input_ids"])

    @routed(model_arg="student")
    def distill(self, teacher: Any, student: Any, ids: torch.Tensor) -> torch.Tensor:
        return _fused_ce(student, ids)


class _Plain:
    def compute_loss(self, model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        return _fused_ce(model, inputs["input_ids"])


def routed_functions_ddp() -> dict[str, Any]:
    """Each way of calling a routed loss under DDP: 0 differ; the undecorated function: all differ."""
    config = TinyConfig()
    ids = torch.randint(0, config.vocab, (2, config.seq), generator=torch.Generator().manual_seed(_rank()))
    loop = _Loop()
    calls: dict[str, Callable[[DDP], torch.Tensor]] = {
        "undecorated": lambda ddp: _fused_ce(ddp.module, ids),
        "function": lambda ddp: routed_fused_ce(ddp, ids),
        "function_kw": lambda ddp: routed_fused_ce(ids=ids, model=ddp),
        "bound_method": lambda ddp: loop.compute_loss(ddp, {"input_ids": ids}),
        "unbound_method": lambda ddp: _Loop.compute_loss(loop, ddp, {"input_ids": ids}),
        "model_arg": lambda ddp: loop.distill(None, ddp, ids),
        "decorated_bound": lambda ddp: routed(_Plain().compute_loss)(ddp, {"input_ids": ids}),
    }
    results: dict[str, Any] = {"seen": routed(lambda model: type(model).__name__)(DDP(build_model(config)))}
    for name, call in calls.items():
        model = build_model(config)
        ddp = DDP(model)
        call(ddp).backward()
        results[name] = _measure(_grads(model))
    return results


# --- HF Trainer with @routed --------------------------------------------------------------------------------


def _tiny_llama(vocab: int, hidden: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config)


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>", "<unk>", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


class _GradProbe:
    """Trainer callback: records every gradient after the backward, before the optimizer touches it."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def __getattr__(self, event: str) -> Callable[..., None]:
        if not event.startswith("on_"):
            raise AttributeError(event)
        return lambda *args, **kwargs: None

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
        self.grads = _grads(model)


def _args(cls: Any, out: str, **extra: Any) -> Any:
    return cls(
        output_dir=out,
        max_steps=1,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        max_grad_norm=0.0,  # clipping would rescale; the comparison wants the raw synced gradient
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        seed=0,
        **extra,
    )


def _lm_rows(rows: int, seq: int) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(1234)  # the same dataset on every rank; the sampler splits it
    ids = torch.randint(4, 4 + len(WORDS), (rows, seq), generator=generator).tolist()
    return [{"input_ids": row, "labels": row} for row in ids]


def _trainer_body(self: Any, model: Any, inputs: dict[str, torch.Tensor], return_outputs: bool = False,
                  num_items_in_batch: Any = None) -> Any:  # fmt: skip
    """A fused-loss ``compute_loss``: unwraps the model and reads ``lm_head.weight`` itself."""
    inner = self.accelerator.unwrap_model(model)
    hidden = inner.model(input_ids=inputs["input_ids"]).last_hidden_state
    logits = hidden[:, :-1] @ inner.lm_head.weight.t()
    loss = F.cross_entropy(logits.flatten(0, 1).float(), inputs["labels"][:, 1:].flatten())
    return (loss, None) if return_outputs else loss


def hf_trainer_routed(decorated: bool) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    class FusedLossTrainer(Trainer):
        compute_loss = routed(_trainer_body) if decorated else _trainer_body

    probe = _GradProbe()
    with tempfile.TemporaryDirectory() as out:
        trainer = FusedLossTrainer(
            model=_tiny_llama(64, 16),
            args=_args(TrainingArguments, out, remove_unused_columns=False),
            train_dataset=Dataset.from_list(_lm_rows(8, 8)),
            callbacks=[probe],  # type: ignore[list-item]
        )
        trainer.train()
    wrapper = type(trainer.model_wrapped).__name__
    return {**_measure(probe.grads), "wrapper": wrapper}


# --- real TRL DPO / KTO with use_liger_kernel=True ----------------------------------------------------------


def _save_tiny(folder: str) -> None:
    _tiny_llama(LIGER_VOCAB, LIGER_HIDDEN).save_pretrained(folder)
    _tokenizer().save_pretrained(folder)


def _sentence(generator: torch.Generator, length: int) -> str:
    return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (length,), generator=generator).tolist())


def _preference_rows(rows: int) -> list[dict[str, str]]:
    generator = torch.Generator().manual_seed(99)
    return [
        {"prompt": _sentence(generator, 4), "chosen": _sentence(generator, 3), "rejected": _sentence(generator, 3)}
        for _ in range(rows)
    ]


def _kto_rows(rows: int) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(77)
    return [
        {"prompt": _sentence(generator, 4), "completion": _sentence(generator, 3), "label": i % 2 == 0}
        for i in range(rows)
    ]


def _fill_model_folder(folder: str) -> None:
    """Rank 0 writes the tiny model into ``folder`` (transformers saves on global rank 0 only once a process
    group exists); the others wait. The test owns and removes the folder: no collective after training."""
    if _rank() == 0 and not os.listdir(folder):
        _save_tiny(folder)
    dist.barrier()


def trl_step(trainer_name: str, variant: str, folder: str) -> dict[str, Any]:
    """One TRL training step with ``use_liger_kernel=True`` on this rank.

    ``variant``: ``"unpatched"`` (TRL as installed), ``"patched"`` (``patch_trl()``), or ``"naive"``
    (``patch_trl(mode="redirect")``: the loss routed through DDP's forward *with* its graph optimizer, i.e. the
    obvious one-line fix). The patch is undone afterwards and Dynamo's caches are dropped first, so every
    variant compiles the Liger loss in its own setting, whatever ran before in this worker.

    Returns this rank's gradients (compared across ranks by the caller) or its error. Nothing collective runs
    after training: a rank that failed must not leave the other waiting in a collective it never joins (the
    other then fails on the group timeout inside TRL's own collectives, and both errors reach the caller).
    """
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from wrapperroute.integrations.trl import patch_trl, unpatch_trl

    torch._dynamo.reset()
    _isolated_losses.clear()
    # A compile that failed inside a torch.func transform (the "naive" variant) leaves saved-tensor hooks
    # disabled; gradient checkpointing would then fail in whatever runs next in this worker.
    if not torch._C._autograd._saved_tensors_hooks_is_enabled():  # type: ignore[attr-defined]
        torch._C._autograd._saved_tensors_hooks_enable()
    start = time.perf_counter()
    result: dict[str, Any] = {"trainer": trainer_name, "variant": variant, "error": None, "differ": None}
    # A DDP forward marker left set by an earlier task (overlapping DDP forwards in threads) would make Dynamo
    # compile even the unpatched loss with DDP's graph optimizer: report it, and compile without it.
    result["stale_ddp_marker"] = DDP._active_ddp_module is not None
    DDP._active_ddp_module = None
    unpatch_trl()
    if variant != "unpatched":
        mode = {"naive": "redirect", "patched": "isolate"}.get(variant, variant)
        result["patch"] = list(patch_trl(mode=mode).patched)  # type: ignore[arg-type]
    probe = _GradProbe()
    try:
        _fill_model_folder(folder)
        with tempfile.TemporaryDirectory() as out:
            model = AutoModelForCausalLM.from_pretrained(folder)
            tokenizer = _tokenizer()
            common = {"use_liger_kernel": True, "liger_kernel_config": NO_TRITON, "remove_unused_columns": False}
            if trainer_name == "dpo":
                from trl import DPOConfig, DPOTrainer

                trainer: Any = DPOTrainer(
                    model=model,
                    args=_args(DPOConfig, out, **common),
                    train_dataset=Dataset.from_list(_preference_rows(8)),
                    processing_class=tokenizer,
                    callbacks=[probe],  # type: ignore[list-item]
                )
            else:
                from trl import KTOConfig, KTOTrainer

                trainer = KTOTrainer(
                    model=model,
                    args=_args(KTOConfig, out, **common),
                    train_dataset=Dataset.from_list(_kto_rows(8)),
                    processing_class=tokenizer,
                    callbacks=[probe],  # type: ignore[list-item]
                )
            trainer.train()
            result["wrapper"] = type(trainer.model_wrapped).__name__
            redirection = getattr(trainer, "_forward_redirection", None)  # the class the trainer routes with
            result["redirection"] = type(redirection).__module__ if redirection is not None else None
    except Exception:
        result["error"] = traceback.format_exc()
    finally:
        unpatch_trl()
    result["grads"] = probe.grads
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def forward_redirection_ddp(use_trl: bool) -> dict[str, Any]:
    """Our ForwardRedirection (or TRL's) under DDP on the fused loss: gradients synced, forward restored."""
    redirection_class: Any
    if use_trl:
        from trl.models.utils import _ForwardRedirection as redirection_class
    else:
        from wrapperroute.integrations.trl import ForwardRedirection as redirection_class

    config = TinyConfig()
    ids = torch.randint(0, config.vocab, (2, config.seq), generator=torch.Generator().manual_seed(_rank()))
    model = build_model(config)
    ddp = DDP(model)
    loss = redirection_class()(ddp, model, _fused_ce, model, ids)
    loss.backward()
    return {**_measure(_grads(model)), "forward_left": "forward" in model.__dict__}


__all__ = ["forward_redirection_ddp", "hf_trainer_routed", "routed_functions_ddp", "trl_step"]
