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


def test_the_example_fused_head_equals_trls() -> None:
    """examples/trl_vocab_parallel_head.py's forward on a tiny Llama whose head is plain: the same
    FusedCausalLMOutput as TRL's add_fused_lm_head (log-probabilities, entropy, loss) and the same gradients of
    every parameter, within 1e-5."""
    import copy
    import sys

    from conftest import REPO
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    sys.path.insert(0, str(REPO / "examples"))
    from trl_vocab_parallel_head import vocab_parallel_fused_head

    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    theirs = LlamaForCausalLM(config)
    ours = copy.deepcopy(theirs)
    for model in (theirs, ours):
        add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    vocab_parallel_fused_head(ours, temperature=0.7)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    labels = ids.masked_fill(torch.arange(9) < 3, -100)
    found = {}
    for name, model in (("ours", ours), ("theirs", theirs)):
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
        (out.loss + 0.1 * out.entropy.sum()).backward()
        found[name] = [out.loss, out.log_probs, out.entropy, *(p.grad for p in model.parameters())]
    assert torch.equal(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)  # unfused: TRL's own forward
    differences = [float((a - b).abs().max()) for a, b in zip(found["ours"], found["theirs"], strict=True)]
    assert max(differences) <= 1e-5, differences


def test_the_example_on_a_sharded_head_gathers_nothing() -> None:
    """The same on a head split on the vocabulary over 2 ranks: equal to TRL's path, which gathers the head
    (``full_tensor()``), with no collective of a head shard's size of ours. Asserted in each rank."""
    import rankside_losses_trl

    from wrapperroute.ranks import RankPool

    with RankPool(2) as pool:
        ranks = pool.run(rankside_losses_trl.example_on_a_sharded_head)
    print(ranks[0])  # the largest difference and collective sizes, under pytest -s
    assert len(ranks) == 2
