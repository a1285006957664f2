"""linear_logprobs against TRL's own ``ChunkedLogProbFunction`` (TRL 1.16's fused LM head; its torch path on
CPU), same options (temperature, softcap, logit_scale, bias), float32: log-probabilities, entropy and their
gradients (hidden states, head, bias) within 1e-5. TRL releases before the fused head have no such function."""

from __future__ import annotations

import itertools

import pytest
import torch

from wrapperroute.losses import linear_logprobs

chunked_logprob = pytest.importorskip(
    "trl.kernels.chunked_logprob", reason="the installed TRL has no trl.kernels.chunked_logprob (TRL >= 1.16 has)"
)

ROWS, HIDDEN, VOCAB = 19, 16, 101


@pytest.mark.parametrize(
    ("temperature", "softcap", "logit_scale", "bias"),
    list(itertools.product([1.0, 0.6], [None, 5.0], [1.0, 0.4], [False, True])),
)
def test_logprobs_and_entropy_equal_trls(temperature: float, softcap: float | None, logit_scale: float,
                                         bias: bool) -> None:  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(ROWS, HIDDEN, generator=generator)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator) * 0.3
    head_bias = torch.randn(VOCAB, generator=generator) if bias else None
    target = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    incoming = torch.randn(2, ROWS, generator=generator)
    found = {}
    for name in ("ours", "trl"):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, head_bias) if t is not None]
        bias_leaf = leaves[2] if bias else None
        if name == "ours":
            logprobs, entropy = linear_logprobs(
                leaves[0],
                leaves[1],
                target,
                bias=bias_leaf,
                softcap=softcap,
                temperature=temperature,
                logit_scale=logit_scale,
                return_entropy=True,
            )
        else:  # vocabulary tiles of 32: several per row, as the fused head's 32768 are on a real vocabulary
            logprobs, entropy, *_ = chunked_logprob.ChunkedLogProbFunction.apply(
                leaves[0], leaves[1], bias_leaf, target, temperature, 32, softcap, logit_scale, ("entropy",)
            )
        grads = torch.autograd.grad((logprobs * incoming[0] + entropy * incoming[1]).sum(), leaves)
        found[name] = [logprobs, entropy, *grads]
    differences = [float((a - b).abs().max()) for a, b in zip(found["ours"], found["trl"], strict=True)]
    assert max(differences) <= 1e-5, differences
    assert found["trl"][2].abs().max() > 0.01  # the premise: gradients that can differ


FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_fused_head_fields_equal_trls(family: str) -> None:
    """The fused forward patch_trl() computes a vocabulary-sharded head with, here on a plain head in one
    process: every field of TRL's FusedCausalLMOutput (the five per-token fields, the label mask, the loss, and
    on an MoE model asking for router logits the load-balancing loss in it) and every parameter's gradient within
    1e-6 of TRL's own forward, for labels shifted by the forward and given shifted with ``num_items_in_batch``,
    with TRL's temperature, softcap and logit scale read as it installed them, in float32 and cast to it."""
    import rankside_losses_trl as body
    from trl.trainer.utils import FusedCausalLMOutput, add_fused_lm_head

    from wrapperroute.integrations._fused_head import installed_settings, vocab_parallel_forward

    worst = 0.0
    for cast in (False, True):
        theirs = body.tiny_model(family)
        add_fused_lm_head(theirs, temperature=0.7, cast_lm_head_to_fp32=cast, outputs=FIELDS)
        settings = installed_settings(theirs.forward)
        assert settings is not None and settings["logit_scale"] == body.LOGIT_SCALE, settings
        assert settings["final_logit_softcapping"] == body.SOFTCAP, settings
        for call in body.calls(family):
            found = {}
            for name in ("ours", "theirs"):
                theirs.zero_grad()
                if name == "ours":
                    out = vocab_parallel_forward(theirs, FusedCausalLMOutput, settings, **call)
                else:
                    out = theirs(**call, fused_lm_head=True)
                body.objective(out).backward()
                found[name] = body.fields(out, theirs)
            differences = body.differences(found["ours"], found["theirs"])
            assert max(differences.values()) <= 1e-6, (family, cast, differences)
            worst = max(worst, *differences.values())
            assert (found["theirs"]["aux_loss"] is not None) == (family == "mixtral"), found["theirs"]["aux_loss"]
            assert found["theirs"]["is_top1"].any() and not found["theirs"]["is_top1"].all()  # the premise
    print(f"{family}: largest difference {worst:.1e}")  # under pytest -s


def test_patched_fused_head_on_a_sharded_head_gathers_nothing() -> None:
    """patch_trl() on TRL's fused head split on the vocabulary over 2 ranks (ColwiseParallel), a tiny Llama and
    a tiny Mixtral: every field and gradient equal to TRL's own path (which gathers the head with
    ``full_tensor()``), with no collective of a head shard's size of ours. Asserted in each rank."""
    import rankside_losses_trl

    from wrapperroute.ranks import RankPool

    with RankPool(2) as pool:
        ranks = pool.run(rankside_losses_trl.patched_on_a_sharded_head)
    print(ranks[0])  # the largest difference and collective sizes, under pytest -s
    assert len(ranks) == 2
