"""Real TRL trainers with ``use_liger_kernel=True``, one step on local CPU ranks: ``wrapperroute check --trl``
and the test suite's TRL tests run the same function.

Everything is built locally (a tiny Llama from a config, a WordLevel tokenizer): nothing is downloaded. The
measurement is the upstream report's: after one step, every parameter's gradient compared across ranks. Each
rank returns its gradients and the caller compares them, so nothing collective runs after training (a rank
that failed must not leave the other waiting in a collective it never joins).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from .._routing.state import forget_isolated
from .._torch_internals import (
    clear_ddp_forward_marker,
    ddp_forward_marker,
    enable_saved_tensor_hooks,
    reset_dynamo,
    saved_tensor_hooks_enabled,
)
from .cell import abs_diff

WORDS = [f"w{i}" for i in range(48)]
# The DPO crash needs the Liger loss's two requires-grad heads (policy, unfrozen reference) to span >= 2 DDP
# buckets (the first is 1 MB): 8192 x 64 float32 = 2 MB each.
LIGER_VOCAB, LIGER_HIDDEN = 8192, 64
# Liger's Triton kernels need a GPU; the chunked DPO/KTO losses (pure torch) still run with these off.
NO_TRITON = {"rope": False, "rms_norm": False, "swiglu": False, "cross_entropy": False,
             "fused_linear_cross_entropy": False}  # fmt: skip
# name -> (modules, config class, trainer class): TRL's trainers with a fused Liger loss, each looked up in the
# installed TRL, in the first of its modules that has it (the distillation trainer moved out of trl.experimental
# in 1.10).
TRAINERS = {
    "dpo": (("trl",), "DPOConfig", "DPOTrainer"),
    "kto": (("trl",), "KTOConfig", "KTOTrainer"),
    "grpo": (("trl",), "GRPOConfig", "GRPOTrainer"),
    "rloo": (("trl",), "RLOOConfig", "RLOOTrainer"),
    "sft": (("trl",), "SFTConfig", "SFTTrainer"),
    "gkd": (("trl.experimental.gkd",), "GKDConfig", "GKDTrainer"),
    "distill": (("trl", "trl.experimental.distillation"), "DistillationConfig", "DistillationTrainer"),
    "gold": (("trl.experimental.gold",), "GOLDConfig", "GOLDTrainer"),
    "iwopd": (("trl.experimental.iw_opd",), "IWOPDConfig", "IWOPDTrainer"),
    "sdpo": (("trl.experimental.sdpo",), "SDPOConfig", "SDPOTrainer"),
    "sdft": (("trl.experimental.sdft",), "SDFTConfig", "SDFTTrainer"),
}


class PathsTaken(logging.Handler):
    """Counts, while entered, the paths the patched TRL methods take (their DEBUG records on
    ``wrapperroute.trl.paths``) by ``"owner: path"``; the logger is put back as it was on exit."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.counts: dict[str, int] = {}
        self._logger = logging.getLogger("wrapperroute.trl.paths")
        self._saved = (self._logger.level, self._logger.propagate)

    def emit(self, record: logging.LogRecord) -> None:
        key = record.getMessage()
        self.counts[key] = self.counts.get(key, 0) + 1

    def __enter__(self) -> PathsTaken:
        self._saved = (self._logger.level, self._logger.propagate)
        self._logger.addHandler(self)
        self._logger.setLevel(logging.DEBUG)
        self._logger.propagate = False  # counted here, not printed by a handler of the script's
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)
        self._logger.level, self._logger.propagate = self._saved


def trainer_classes(name: str) -> tuple[Any, Any] | None:
    """(config class, trainer class) of ``TRAINERS[name]`` in the installed TRL, or None where it has neither.
    An import that fails with anything but ImportError propagates (the caller names it)."""
    import importlib

    modules, config_name, trainer_name = TRAINERS[name]
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        config, trainer = getattr(module, config_name, None), getattr(module, trainer_name, None)
        if config is not None and trainer is not None:
            return config, trainer
    return None


# A tiny chat template (GKD's collator applies one); the words only need to be in the vocabulary.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w0{% endif %}"


def tiny_llama(vocab: int, hidden: int) -> Any:
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


def tokenizer(byte_level: bool = False) -> Any:
    """A WordLevel tokenizer of ``WORDS``; ``byte_level``: a ByteLevel BPE one trained on them (GOLD's data
    set-up reads byte offsets and accepts only those)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    if byte_level:
        core = Tokenizer(models.BPE())
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        core.decoder = decoders.ByteLevel()
        learn = trainers.BpeTrainer(vocab_size=512, special_tokens=specials, show_progress=False,
                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
        core.train_from_iterator([" ".join(WORDS)], learn)
    else:
        core = Tokenizer(models.WordLevel({token: i for i, token in enumerate([*specials, *WORDS])}, unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.Whitespace()
    made = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    made.chat_template = CHAT_TEMPLATE
    return made


def training_args(cls: Any, out: str, **extra: Any) -> Any:
    """``cls`` (a TRL config) for one fp32 step; of ``extra``, only what this release's config has (an option a
    trainer gained later, such as SDPO's ``distillation_is_clip``, does not exist to be set in earlier ones)."""
    fields = {field.name for field in dataclasses.fields(cls)}
    if "use_liger_kernel" in extra and "use_liger_kernel" not in fields:
        raise ValueError(f"{cls.__name__} has no use_liger_kernel: this release's trainer has no Liger path")
    return cls(
        output_dir=out,
        max_steps=1,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        max_grad_norm=0.0,  # clipping would rescale; the comparison wants the raw synced gradient
        # fp32 throughout (TRL's configs default to bf16 where the machine has it): gradients compared at 1e-6
        bf16=False,
        fp16=False,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        dataloader_num_workers=0,
        seed=0,
        **{key: value for key, value in extra.items() if key in fields},
    )


def _sentence(generator: torch.Generator, length: int) -> str:
    return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (length,), generator=generator).tolist())


def preference_rows(rows: int) -> list[dict[str, str]]:
    generator = torch.Generator().manual_seed(99)
    return [
        {"prompt": _sentence(generator, 4), "chosen": _sentence(generator, 3), "rejected": _sentence(generator, 3)}
        for _ in range(rows)
    ]


def lm_rows(rows: int, seq: int) -> list[list[int]]:
    """Token rows for a language-model step: the same on every rank (the sampler splits them)."""
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(4, 4 + len(WORDS), (rows, seq), generator=generator).tolist()


def _kto_rows(rows: int) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(77)
    return [
        {"prompt": _sentence(generator, 4), "completion": _sentence(generator, 3), "label": i % 2 == 0}
        for i in range(rows)
    ]


def _chat_rows(rows: int) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(55)
    return [
        {"messages": [{"role": "user", "content": _sentence(generator, 4)},
                      {"role": "assistant", "content": _sentence(generator, 3)}]}
        for _ in range(rows)
    ]  # fmt: skip


def _text_rows(rows: int) -> list[dict[str, str]]:
    """Texts of 3 to 6 words: a different number of valid tokens on every rank."""
    generator = torch.Generator().manual_seed(21)
    return [{"text": _sentence(generator, 3 + i % 4)} for i in range(rows)]


def _prompt_rows(rows: int) -> list[dict[str, str]]:
    generator = torch.Generator().manual_seed(33)
    return [{"prompt": _sentence(generator, 4)} for _ in range(rows)]


def _reward(completions: list[str], completion_ids: list[list[int]] | None = None, **_: Any) -> list[float]:
    """A deterministic reward that differs between completions, so GRPO's advantages are not all 0. Read from
    the token ids where TRL passes them: the tiny tokenizer decodes most of a random model's tokens to ''."""
    rows = completion_ids if completion_ids is not None else [list(map(ord, text)) for text in completions]
    return [float(sum(ids) % 7) for ids in rows]


def _setup(trainer_name: str, folder: str, layout: str) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """(rows, extra config arguments, extra trainer arguments) for one trainer's step."""
    from transformers import AutoModelForCausalLM

    # Some releases refuse to copy the policy into a reference model under ZeRO-3 ("not compatible with
    # create_reference_model()"): there it is given, as they ask, with the same weights.
    ref = {"ref_model": AutoModelForCausalLM.from_pretrained(folder)} if layout == "zero3" else {}
    if trainer_name == "dpo":
        return preference_rows(8), {}, ref
    if trainer_name == "kto":
        return _kto_rows(8), {}, ref
    if trainer_name == "sft":
        return _text_rows(8), {"max_length": 16}, {}
    generated: dict[str, Any] = {"num_generations": 2, "max_completion_length": 4}
    # SDPO and SDFT take the fused JSD only on full logits, unclipped
    self_distilled = generated | {"distillation_mode": "full_logits", "distillation_is_clip": None}
    if trainer_name in ("grpo", "rloo"):
        return _prompt_rows(8), generated | {"beta": 0.0}, {"reward_funcs": _reward}
    if trainer_name == "sdpo":  # every rollout a success, every teacher reprompted with one: a non-zero JSD
        config = {"loss_type": "bnpo", "success_reward_threshold": 0.0, "dont_reprompt_on_self_success": False}
        return _prompt_rows(8), self_distilled | config, {"reward_funcs": _reward}
    if trainer_name == "sdft":  # the teacher: the policy shown a privileged context
        return [row | {"privileged_context": row["prompt"]} for row in _prompt_rows(8)], self_distilled, {}
    teacher = AutoModelForCausalLM.from_pretrained(folder)  # the same weights: a real, non-zero JSD all the same
    torch.manual_seed(1)
    with torch.no_grad():
        for param in teacher.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    if trainer_name in ("gkd", "gold"):  # off-policy only (lmbda 0): no generation, the step is the Liger JSD loss
        config = {"lmbda": 0.0, "seq_kd": False, "max_length": 16, "max_completion_length": 4}
        return _chat_rows(8), config, {"teacher_model": teacher}
    # Greedy on-policy generation: sampled, ZeRO-3's rollouts differ from the reference's (0.0055 apart)
    greedy = {"top_k": 1, "max_completion_length": 4}
    if trainer_name == "iwopd":  # its Liger path is the JSD objective; its collator reads chat messages
        return _chat_rows(8), greedy | {"distillation_objective": "jsd"}, {"teacher_model": teacher}
    # The distillation trainer: a prompt from 1.10, chat messages in trl.experimental before (each reads its own)
    rows = [prompt | chat for prompt, chat in zip(_prompt_rows(8), _chat_rows(8), strict=True)]
    return rows, greedy, {"teacher_model": teacher}


def _fill_model_folder(folder: str) -> None:
    """Rank 0 writes the tiny model into ``folder`` (transformers saves on global rank 0 only once a process
    group exists); the others wait. The caller owns and removes the folder."""
    if dist.get_rank() == 0 and not os.listdir(folder):
        tiny_llama(LIGER_VOCAB, LIGER_HIDDEN).save_pretrained(folder)
        tokenizer().save_pretrained(folder)
    dist.barrier()


def trl_step(trainer_name: str, variant: str, folder: str, layout: str = "ddp") -> dict[str, Any]:
    """One TRL training step with ``use_liger_kernel=True`` on this rank, the model under ``layout`` (see
    ``trl_layouts``; ``"local"``: unwrapped, the reference).

    ``variant``: ``"unpatched"`` (TRL as installed), ``"patched"`` (``patch_trl()``), or ``"naive"``
    (``patch_trl(mode="redirect")``: the loss routed through DDP's forward *with* its graph optimizer, i.e. the
    obvious one-line fix). The patch is undone afterwards and Dynamo's caches are dropped first, so every
    variant compiles the Liger loss in its own setting, whatever ran before in this worker.

    Returns this rank's whole gradients (compared across ranks by the caller) or its error.
    """
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from ..integrations.trl import patch_trl, unpatch_trl
    from .trl_layouts import GradProbe, layout_args
    from .trl_layouts import layout as under

    reset_dynamo()
    forget_isolated()
    # A compile that failed inside a torch.func transform (the "naive" variant) leaves saved-tensor hooks
    # disabled; gradient checkpointing would then fail in whatever runs next in this worker.
    if not saved_tensor_hooks_enabled():
        enable_saved_tensor_hooks()
    start = time.perf_counter()
    result: dict[str, Any] = {"trainer": trainer_name, "variant": variant, "layout": layout, "error": None,
                              "differ": None}  # fmt: skip
    # A DDP forward marker left set by an earlier task (overlapping DDP forwards in threads) would make Dynamo
    # compile even the unpatched loss with DDP's graph optimizer: report it, and compile without it.
    result["stale_ddp_marker"] = ddp_forward_marker() is not None
    clear_ddp_forward_marker()
    unpatch_trl()
    if variant != "unpatched":
        result["patch"] = list(patch_trl(mode="redirect" if variant == "naive" else "isolate").patched)
    probe = GradProbe()
    taken = PathsTaken()
    try:
        found = trainer_classes(trainer_name)
        if found is None:
            raise LookupError(f"the installed TRL has no {TRAINERS[trainer_name][2]}")
        config_cls, trainer_cls = found
        _fill_model_folder(folder)
        with tempfile.TemporaryDirectory() as out, under(layout, probe), taken:
            rows, config, extra = _setup(trainer_name, folder, layout)
            common = {"use_liger_kernel": True, "liger_kernel_config": NO_TRITON, "remove_unused_columns": False}
            trainer: Any = trainer_cls(
                model=AutoModelForCausalLM.from_pretrained(folder),
                args=training_args(config_cls, out, **common, **config, **layout_args(layout)),
                train_dataset=Dataset.from_list(rows),
                processing_class=tokenizer(byte_level=trainer_name == "gold"),
                callbacks=[probe],
                **extra,
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
    result["liger_paths"] = taken.counts
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result


def compare_ranks(results: list[dict[str, Any]], reference: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Rank 0's row with every rank's error and, when every rank trained, the gradients compared across ranks
    (``params``, ``differ``, ``max_diff``; ``nonzero``: parameters with a non-zero gradient on rank 0) and, given
    the ranks' results of the ``local`` layout, with the mean of their gradients (``ref_diff``: what every
    data-parallel wrapper must produce; None when the reference run failed)."""
    errors = {rank: r["error"] for rank, r in enumerate(results) if r["error"]}
    row = {key: value for key, value in results[0].items() if key != "grads"}
    row.update(errors=errors, error=results[0]["error"] or next(iter(errors.values()), None), ref_diff=None)
    if not errors:
        grads = [r["grads"] for r in results]
        if not grads[0] or any(g.keys() != grads[0].keys() for g in grads):
            row["error"] = "the ranks recorded no gradients, or different parameters"
            return row
        diffs = [max(abs_diff(g[name], grads[0][name]) for g in grads[1:]) for name in grads[0]]
        nonzero = sum(bool(grad.any()) for grad in grads[0].values())  # a step with no gradient proves nothing
        row.update(params=len(diffs), differ=sum(d > 0 for d in diffs), max_diff=max(diffs), nonzero=nonzero)
        mean = reference_grads(reference) if reference is not None else None
        if mean is not None and mean.keys() == grads[0].keys():
            row["ref_diff"] = max(abs_diff(grads[0][name], mean[name]) for name in mean)
    return row


def reference_grads(local: list[dict[str, Any]]) -> dict[str, torch.Tensor] | None:
    """The mean over ranks of the gradients each rank computed alone (the ``local`` layout), or None."""
    if any(r["error"] or not r["grads"] for r in local):
        return None
    names = local[0]["grads"].keys()
    return {name: torch.stack([r["grads"][name] for r in local]).mean(0) for name in names}
