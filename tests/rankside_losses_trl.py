"""Rank bodies for tests/test_losses_trl.py: TRL's fused LM head patched by ``patch_trl()`` on a head sharded on
the vocabulary, against TRL's own on the same model; and the models, calls and comparisons the one-process test
shares (module level: the pool pickles them by reference)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

VOCAB = 97  # uneven over 2 ranks: shards of 49 and 48 rows
SOFTCAP, LOGIT_SCALE = 4.0, 0.8  # read by TRL's installer off the config (Gemma's cap, Cohere's scale)
FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def tiny_model(family: str) -> Any:
    """A tiny Llama, or a tiny Mixtral asking for router logits (its forward adds the load-balancing term), with
    a logit softcap and scale on the config."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    common = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 32}  # fmt: skip
    torch.manual_seed(0)
    if family == "mixtral":
        config: Any = MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                                    router_aux_loss_coef=0.3)  # fmt: skip
        model: Any = MixtralForCausalLM(config)
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.config.final_logit_softcapping = SOFTCAP
    model.config.logit_scale = LOGIT_SCALE
    return model


def calls(family: str) -> list[dict[str, Any]]:
    """Labels the forward shifts (a prompt masked), then labels given shifted with ``num_items_in_batch``; every
    other label the model's greedy next token (is_top1 has both answers; the logits' transform keeps the
    order)."""
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        greedy = tiny_model(family)(input_ids=ids).logits.argmax(dim=-1)
    labels = ids.clone()
    labels[:, 1::2] = greedy[:, 0:-1:2]  # the label at t is predicted at t - 1
    labels = labels.masked_fill(torch.arange(9) < 3, -100)
    shifted = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
    return [{"input_ids": ids, "labels": labels},
            {"input_ids": ids, "shift_labels": shifted, "num_items_in_batch": torch.tensor(7)}]  # fmt: skip


def objective(out: Any) -> torch.Tensor:
    return out.loss + 0.1 * out.entropy.sum()  # type: ignore[no-any-return]


def fields(out: Any, model: Any) -> dict[str, Any]:
    """Every field of the output and every parameter's gradient, whole."""
    from torch.distributed.tensor import DTensor

    found = {name: getattr(out, name) for name in ("loss", *FIELDS, "label_mask", "aux_loss")}
    for name, param in model.named_parameters():
        grad = param.grad
        found[f"{name}.grad"] = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return found


def differences(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float]:
    assert ours.keys() == theirs.keys()
    found = {}
    for name, value in theirs.items():
        if value is None:
            assert ours[name] is None, name
            continue
        assert ours[name] is not None and ours[name].shape == value.shape, (name, ours[name])
        found[name] = float((ours[name].double() - value.double()).abs().max())
    return found


def _gloo_sizes(run: Any) -> tuple[list[int], Any]:
    """The elements of every gloo collective ``run`` makes, as the profiler sees them, and what it returned."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        result = run()
    found = [event for event in prof.events() if event.name.startswith("gloo:")]
    return [int(torch.tensor(shape).prod()) for event in found for shape in event.input_shapes if shape], result


def patched_on_a_sharded_head() -> dict[str, Any]:
    """Each family's model with ``lm_head`` split on the vocabulary over every rank (``ColwiseParallel``), TRL's
    ``add_fused_lm_head`` as installed and as ``patch_trl()`` wraps it: the same output fields and parameter
    gradients (1e-6) for each call; ours moves nothing of a head shard's size, TRL's moves the head."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from trl.trainer import utils

    from wrapperroute.check.trl_cells import PathsTaken
    from wrapperroute.integrations.trl import patch_trl, unpatch_trl

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    largest, moved_most = 0.0, {"ours": 0, "theirs": 0}
    for family in ("llama", "mixtral"):
        theirs = tiny_model(family)
        ours = copy.deepcopy(theirs)
        models = {"ours": ours, "theirs": theirs}
        for name, model in models.items():
            parallelize_module(model, mesh, {"lm_head": ColwiseParallel(use_local_output=False)})
            unpatch_trl()
            if name == "ours":
                patch_trl()
            utils.add_fused_lm_head(model, temperature=0.7, outputs=FIELDS)
        unpatch_trl()  # the model keeps the forward it was given
        with torch.no_grad():  # generation's forward (fused_lm_head=False) is TRL's, whose is the model's own
            logits = [model(input_ids=calls(family)[0]["input_ids"]).logits for model in (ours, theirs)]
        assert torch.equal(*(value.full_tensor() if isinstance(value, DTensor) else value for value in logits))
        head = ours.get_output_embeddings().weight
        assert isinstance(head, DTensor) and head.to_local().shape[0] < VOCAB, head  # the premise: a shard per rank
        shard = min(VOCAB // dist.get_world_size(), head.to_local().shape[0]) * ours.config.hidden_size
        taken = PathsTaken()
        with taken:
            for call in calls(family):
                found, moved = {}, {}
                for name, model in models.items():
                    model.zero_grad()

                    def step(model: Any = model, call: dict[str, Any] = call) -> Any:
                        out = model(**call, fused_lm_head=True)
                        objective(out).backward()
                        return out

                    moved[name], out = _gloo_sizes(step)
                    found[name] = fields(out, model)
                assert max(moved["theirs"]) >= shard, (moved["theirs"], shard)  # the premise: TRL's path gathers it
                assert moved["ours"] and max(moved["ours"]) < shard, (moved["ours"], shard)
                found_differences = differences(found["ours"], found["theirs"])
                assert max(found_differences.values()) <= 1e-6, (family, call.keys(), found_differences)
                assert found["theirs"]["lm_head.weight.grad"].abs().max() > 0.01  # the premise: a head gradient
                assert (found["theirs"]["aux_loss"] is not None) == (family == "mixtral")
                largest = max(largest, *found_differences.values())
                moved_most = {name: max(moved_most[name], *moved[name]) for name in moved}
        assert taken.counts == {"add_fused_lm_head: fused head computed on its vocabulary shard": 2}, taken.counts
    return {"largest": largest, **moved_most}
