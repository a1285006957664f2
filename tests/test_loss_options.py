"""wrapperroute.losses' options (temperature, softcap, logit_scale, bias, entropy, label smoothing, z-loss,
ignore_index, every reduction, chunk sizes), each alone and all together: values and gradients (hidden states,
head, bias; the entropy's included) within 1e-9 of float64 logits materialised by the formula through torch's
own log_softmax and cross_entropy (float64 inputs), within 1e-5 (float32 inputs), on one process. Targets that
are not token ids raise, naming the first. The same cases on a head sharded over 2 and 4 ranks, with hidden
states whole or sharded on tokens, and bad targets on every rank: tests/test_tensor_parallel.py."""

from __future__ import annotations

import dataclasses
import os

import loss_reference as ref
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import wrapperroute as wr
from wrapperroute.losses import linear_cross_entropy, linear_logprobs

EXAMPLES = 200 if os.environ.get("WRAPPERROUTE_LONG") else 40


def _differences(case: ref.Case, rows: int = 13, hidden_size: int = 6, vocab: int = 29, seed: int = 0,
                 premise: bool = True) -> dict:  # fmt: skip
    made = ref.inputs(case, rows, hidden_size, vocab, seed)
    leaves = {name: made[name].clone().requires_grad_() for name in ("hidden", "weight", "bias")
              if made[name] is not None}  # fmt: skip
    exact = {name: value.detach().double().requires_grad_() for name, value in leaves.items()}
    found = ref.ours(case, leaves["hidden"], leaves["weight"], leaves.get("bias"), made["target"])
    expected = ref.truth(case, exact["hidden"], exact["weight"], exact.get("bias"), made["target"])
    dtype = torch.float32 if case.float32 else torch.float64
    assert all(value.dtype == dtype for value in found.values()), found
    grads = torch.autograd.grad(ref.objective(found, made), list(leaves.values()))
    truths = torch.autograd.grad(ref.objective(expected, made),
                                 list(exact.values()))  # fmt: skip
    differences = {name: float((found[name].detach().double() - expected[name].detach()).abs().max()) for name in found}
    for name, ours, theirs in zip(leaves, grads, truths, strict=True):
        differences[f"{name}.grad"] = float((ours.double() - theirs).abs().max())
        assert not premise or theirs.abs().max() > 0.01, name  # the premise: gradients that can differ
    return differences


@pytest.mark.parametrize("case", ref.CASES, ids=str)
def test_each_option_alone_and_together(case: ref.Case) -> None:
    differences = _differences(case)
    assert max(differences.values()) <= case.tolerance, differences
    print(f"largest difference {max(differences.values()):.1e}")  # shown under pytest -s


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    temperature=st.floats(0.3, 3.0), softcap=st.none() | st.floats(0.5, 30.0), logit_scale=st.floats(-2.0, 2.0),
    bias=st.booleans(), entropy=st.booleans(), statistics=st.booleans(), label_smoothing=st.floats(0.0, 1.0),
    z_loss=st.floats(0.0, 0.1),
    ignore_index=st.sampled_from([-100, 0, 5]), reduction=st.sampled_from(["mean", "sum", "none"]),
    chunk_size=st.none() | st.integers(1, 20), rows=st.integers(3, 24), vocab=st.integers(2, 40),
)  # fmt: skip
def test_any_options_float64(rows: int, vocab: int, **options: object) -> None:
    case = ref.Case(**options)  # type: ignore[arg-type]
    assert max(_differences(case, rows=rows, vocab=vocab, seed=rows, premise=False).values()) <= 1e-9


class _LogitPasses(TorchDispatchMode):
    """Counts the operations whose result is a slice of every token's logits (``rows`` by some of the
    vocabulary): each one pass over the logits the backward recomputes."""

    def __init__(self, rows: int, hidden_size: int) -> None:
        super().__init__()
        self.rows, self.hidden_size, self.passes = rows, hidden_size, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        shape = out.shape if isinstance(out, torch.Tensor) else ()
        self.passes += len(shape) == 2 and shape[0] == self.rows and shape[1] != self.hidden_size
        return out


def test_an_unused_entropy_costs_the_backward_nothing() -> None:
    """The backward of log-probabilities alone makes as many passes over the logits whether the entropy was
    returned (and left unused) or not; with the entropy's gradient it makes more."""
    made = ref.inputs(ref.Case(), 12, 6, 29, seed=3)
    passes = {}
    for name, entropy, use in (("plain", False, False), ("returned", True, False), ("used", True, True)):
        hidden = made["hidden"].clone().requires_grad_()
        found = linear_logprobs(hidden, made["weight"], made["target"], return_entropy=entropy, chunk_size=4)
        total = (found[0] + found[1]).sum() if use else (found[0] if entropy else found).sum()
        with _LogitPasses(12, 6) as counted:
            total.backward()
        passes[name] = counted.passes
    assert 0 < passes["plain"] == passes["returned"] < passes["used"], passes


def test_half_precision_statistics_are_float32() -> None:
    """bfloat16 hidden states and head: log-probabilities and entropy in float32, within bfloat16's rounding of
    the logits of the float64 truth; gradients in bfloat16."""
    case = ref.Case(entropy=True, softcap=3.0, temperature=0.8)
    made = ref.inputs(case, 16, 8, 29, seed=4)
    expected = ref.truth(case, made["hidden"], made["weight"], None, made["target"])
    hidden = made["hidden"].bfloat16().requires_grad_()
    logprobs, entropy = linear_logprobs(hidden, made["weight"].bfloat16(), made["target"], return_entropy=True,
                                        softcap=3.0, temperature=0.8)  # fmt: skip
    (logprobs + entropy).sum().backward()
    assert logprobs.dtype == entropy.dtype == torch.float32 and hidden.grad is not None
    assert hidden.grad.dtype == torch.bfloat16
    assert float((logprobs.double() - expected["logprobs"]).abs().max()) < 0.1
    assert float((entropy.double() - expected["entropy"]).abs().max()) < 0.1


@pytest.mark.parametrize(
    ("target", "error", "words"),
    [
        (lambda t: t.index_fill(0, torch.tensor([6]), 29), wr.RouteValueError, r"target\[6\] = 29 is not a token id"),
        (lambda t: t.index_fill(0, torch.tensor([2]), -3), wr.RouteValueError, r"target\[2\] = -3 is not a token id"),
        (lambda t: t.float(), wr.RouteTypeError, "integer token ids"),
        (lambda t: t > 3, wr.RouteTypeError, "integer token ids"),
    ],
)
def test_bad_targets_are_named(target: object, error: type[Exception], words: str) -> None:
    made = ref.inputs(ref.Case(), 12, 6, 29, seed=5)
    bad = target(made["target"].clamp(min=0))  # type: ignore[operator]
    for loss in (linear_logprobs, linear_cross_entropy):
        with pytest.raises(error, match=words):
            loss(made["hidden"], made["weight"], bad)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"temperature": 0.0}, "temperature must be a finite number in"),
        ({"softcap": -1.0}, "softcap must be a finite number in"),
        ({"logit_scale": float("nan")}, "logit_scale must be a finite number"),
        ({"label_smoothing": 1.5}, "label_smoothing must be a finite number in"),
        ({"z_loss": -0.1}, "z_loss must be a finite number in"),
        ({"bias": torch.zeros(3, dtype=torch.float64)}, r"bias must be the head's \(V,\)"),
    ],
)
def test_bad_options_are_named(options: dict, words: str) -> None:
    made = ref.inputs(ref.Case(), 12, 6, 29, seed=5)
    with pytest.raises(wr.RouteValueError, match=words):
        linear_cross_entropy(made["hidden"], made["weight"], made["target"], **options)


def test_cases_cover_every_option() -> None:
    """The premise of the tables above: each field of Case takes a value other than its default, alone and in
    the combined cases."""
    defaults = ref.Case()
    for field in dataclasses.fields(ref.Case):
        alone = [case for case in ref.ALONE if getattr(case, field.name) != getattr(defaults, field.name)]
        assert field.name == "float32" or alone, field.name
