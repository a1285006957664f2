"""Rank bodies for tests/test_losses_trl.py: the example's fused head on a head sharded on the vocabulary, against
TRL's own on the same model (module level: the pool pickles them by reference)."""

from __future__ import annotations

import copy
import sys
from typing import Any

import torch
import torch.distributed as dist
from conftest import REPO

sys.path.insert(0, str(REPO / "examples"))
from trl_vocab_parallel_head import vocab_parallel_fused_head

VOCAB = 97  # uneven over 2 ranks: shards of 49 and 48 rows


def _gloo_sizes(run: Any) -> tuple[list[int], Any]:
    """The elements of every gloo collective ``run`` makes, as the profiler sees them, and what it returned."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        result = run()
    found = [event for event in prof.events() if event.name.startswith("gloo:")]
    return [int(torch.tensor(shape).prod()) for event in found for shape in event.input_shapes if shape], result


def example_on_a_sharded_head() -> dict[str, Any]:
    """A tiny Llama whose ``lm_head`` is split on the vocabulary over every rank (``ColwiseParallel``), patched by
    TRL's ``add_fused_lm_head`` and then, for ours, by the example: the same loss, log-probabilities, entropy and
    gradients of every parameter as TRL's path (which gathers the head with ``full_tensor()``), within 1e-5; ours
    moves nothing of a head shard's size, TRL's moves the head."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    theirs = LlamaForCausalLM(config)
    ours = copy.deepcopy(theirs)
    for model in (theirs, ours):
        parallelize_module(model, mesh, {"lm_head": ColwiseParallel(use_local_output=False)})
        add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    vocab_parallel_fused_head(ours, temperature=0.7)
    head = ours.get_output_embeddings().weight
    assert isinstance(head, DTensor) and head.to_local().shape[0] < VOCAB, head  # the premise: a shard per rank
    shard = min(VOCAB // dist.get_world_size(), head.to_local().shape[0]) * config.hidden_size

    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    labels = ids.masked_fill(torch.arange(9) < 3, -100)
    found, moved = {}, {}
    for name, model in (("ours", ours), ("theirs", theirs)):

        def step(model: Any = model) -> list[torch.Tensor]:
            out = model(input_ids=ids, labels=labels, fused_lm_head=True)
            (out.loss + 0.1 * out.entropy.sum()).backward()
            return [out.loss, out.log_probs, out.entropy]

        moved[name], outputs = _gloo_sizes(step)
        grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
        found[name] = [*outputs, *grads]
    assert max(moved["theirs"]) >= shard, (moved["theirs"], shard)  # the premise: TRL's path gathers the head
    assert moved["ours"] and max(moved["ours"]) < shard, (moved["ours"], shard)
    differences = [float((a - b).abs().max()) for a, b in zip(found["ours"], found["theirs"], strict=True)]
    assert max(differences) <= 1e-5, differences
    assert found["theirs"][-1].abs().max() > 0.01  # the head's gradient (lm_head is the last parameter)
    return {"largest": max(differences), "ours": max(moved["ours"]), "theirs": max(moved["theirs"]), "shard": shard}
