"""wrapperroute.losses on one process: the same values and gradients as materialised logits through torch's own
cross-entropy and log-softmax (float64: to 1e-12), every reduction, ignore_index, chunk sizes; float32
accumulation under bfloat16; clear errors for what it cannot take."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import wrapperroute as wr
from wrapperroute.losses import linear_cross_entropy, linear_logprobs


def _inputs(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=generator, dtype=dtype).requires_grad_()
    weight = torch.randn(101, 16, generator=generator, dtype=dtype).requires_grad_()
    target = torch.randint(0, 101, (37,), generator=generator)
    target[[3, 7]] = -100
    return hidden, weight, target


def _grads(out: torch.Tensor, incoming: torch.Tensor, *inputs: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad((out * incoming).sum(), inputs))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("chunk_size", [None, 1, 5, 100])
def test_cross_entropy_is_torchs(reduction: str, chunk_size: int | None) -> None:
    hidden, weight, target = _inputs()
    ours = linear_cross_entropy(hidden, weight, target, reduction=reduction, chunk_size=chunk_size)  # type: ignore[arg-type]
    theirs = F.cross_entropy(hidden @ weight.t(), target, reduction=reduction)
    incoming = torch.randn_like(theirs)
    assert ours.dtype == torch.float64 and ours.shape == theirs.shape
    assert torch.allclose(ours, theirs, atol=1e-12, rtol=0)
    for a, b in zip(_grads(ours, incoming, hidden, weight), _grads(theirs, incoming, hidden, weight), strict=True):
        assert torch.allclose(a, b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_logprobs_are_log_softmax(chunk_size: int | None) -> None:
    hidden, weight, target = _inputs()
    target = target.clamp(min=0)
    ours = linear_logprobs(hidden, weight, target, chunk_size=chunk_size)
    theirs = torch.log_softmax(hidden @ weight.t(), dim=-1).gather(1, target[:, None]).squeeze(1)
    incoming = torch.randn_like(theirs)
    assert torch.allclose(ours, theirs, atol=1e-12, rtol=0)
    for a, b in zip(_grads(ours, incoming, hidden, weight), _grads(theirs, incoming, hidden, weight), strict=True):
        assert torch.allclose(a, b, atol=1e-12, rtol=0)


def test_no_token_kept_is_nan_as_torch_with_zero_gradients() -> None:
    """An all-padding batch: the loss NaN and the gradients 0, as torch's (a NaN gradient would spread to every
    rank through the data-parallel all-reduce)."""
    hidden, weight, target = _inputs()
    ignored = torch.full_like(target, -100)
    ours = linear_cross_entropy(hidden, weight, ignored)
    theirs = F.cross_entropy(hidden @ weight.t(), ignored)
    assert torch.isnan(ours) and torch.isnan(theirs)
    expected = torch.autograd.grad(theirs, (hidden, weight))
    for a, b in zip(torch.autograd.grad(ours, (hidden, weight)), expected, strict=True):
        assert torch.equal(a, b) and not a.any()


def _matmuls(run: object) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run()  # type: ignore[operator]
    return sum(1 for event in prof.events() if event.name in ("aten::mm", "aten::addmm_"))


def test_no_gradient_work_under_no_grad() -> None:
    """An evaluation loss computes the logits only: one matmul per chunk, none for gradients."""
    hidden, weight, target = _inputs()
    with torch.no_grad():
        assert _matmuls(lambda: linear_cross_entropy(hidden, weight, target, chunk_size=10)) == 4
    assert _matmuls(lambda: linear_cross_entropy(hidden, weight, target, chunk_size=10)) == 12  # the premise


def test_bfloat16_inputs_accumulate_in_float32() -> None:
    """bfloat16 hidden states and head: the loss in float32, within bfloat16's logits rounding of the float64
    value; the gradients in the inputs' dtype; a frozen head gets no gradient and costs none."""
    hidden, weight, target = _inputs()
    exact = F.cross_entropy(hidden @ weight.t(), target)
    low = hidden.detach().bfloat16().requires_grad_()
    frozen = weight.detach().bfloat16()
    loss = linear_cross_entropy(low, frozen, target)
    loss.backward()
    assert loss.dtype == torch.float32 and abs(float(loss.detach()) - float(exact.detach())) < 0.05
    assert low.grad is not None and low.grad.dtype == torch.bfloat16 and frozen.grad is None


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda h, w, t: linear_cross_entropy(h[None], w, t), wr.RouteValueError, "flatten batch and sequence"),
        (lambda h, w, t: linear_cross_entropy(h, w, t[:-1]), wr.RouteValueError, r"target must be \(N,\)"),
        (lambda h, w, t: linear_cross_entropy(h, w.float(), t), wr.RouteTypeError, "must share a dtype"),
        (lambda h, w, t: linear_cross_entropy(h, w, t, reduction="max"), wr.RouteValueError, "reduction must be"),
        (lambda h, w, t: linear_cross_entropy(h, w, t, chunk_size=0), wr.RouteValueError, "positive number"),
        (lambda h, w, t: linear_logprobs(h, w[0], t), wr.RouteValueError, r"\(V, H\) matrix"),
        (lambda h, w, t: linear_logprobs(h.tolist(), w, t), wr.RouteTypeError, "hidden must be a tensor"),
    ],
)
def test_bad_input_is_named(call: object, error: type[Exception], words: str) -> None:
    hidden, weight, target = _inputs()
    with pytest.raises(error, match=words):
        call(hidden, weight, target)  # type: ignore[operator]


def test_is_top1_is_argmaxs_first_maximum() -> None:
    """Two words share the largest logit: only the first is the top-1 word, as ``argmax`` (and TRL) say; a target
    below them is not; an ignored token is False. The same across a vocabulary split between ranks:
    tests/test_tensor_parallel.py::test_is_top1_across_shards."""
    hidden = torch.eye(4)[[0, 0, 0, 0]]  # every token the same: words 3 and 7 its largest logits
    weight = torch.full((10, 4), 0.1)
    weight[3, 0] = weight[7, 0] = 5.0
    target = torch.tensor([3, 7, 5, -100])
    found = linear_logprobs(hidden, weight, target, outputs=("is_top1",))
    assert found["is_top1"].tolist() == [True, False, False, False], found["is_top1"]
