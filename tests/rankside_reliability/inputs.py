"""Rank bodies for tests/test_reliability.py: bad input on real wrappers, and legitimate odd uses."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rankside_reliability import CONFIG, build, changed, snapshot, truth_step
from wrapperroute import route_loss
from wrapperroute.check.cell import REFERENCE_TOLERANCE, differing_across_ranks
from wrapperroute.check.losses import LOSSES, make_batch
from wrapperroute.check.models import build_model


class _Holder:
    """A loss inside an object DDP's output walk cannot see."""

    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss


def bad_input(case: str, error: str, words: str, fix: str | None) -> None:
    """One mistake made against a real DDP (``find_unused_parameters=True``) or FSDP2 model (the cases ending in
    ``-fsdp2``): the exception ``error`` saying ``words`` (and the ``fix``, where given), a WrapperRouteError and
    a TypeError or ValueError; the wrapper exactly as before (forward attributes, hook counts, layout); and a
    routed step on the same model afterwards exact."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if case.endswith("-fsdp2"):
        wrapped, reference = build("fsdp2", {"groups": "layers"})
    else:
        wrapped, reference = build("ddp", {"find_unused_parameters": True})
    model, inner = wrapped.model, wrapped.inner
    ids = make_batch(LOSSES["fused_ce"], CONFIG, dist.get_rank(), 0, 0)["input_ids"]

    def loss() -> torch.Tensor:
        return (inner(ids) @ inner.lm_head.weight.t()).logsumexp(-1).mean()

    async def async_loss() -> torch.Tensor:
        return loss()

    def generator_loss() -> Any:
        yield loss()

    calls: dict[str, Any] = {
        "unwrapped-is-the-wrapper": lambda: route_loss(model, model, loss),
        "unwrapped-of-another-model": lambda: route_loss(model, DDP(build_model(CONFIG)).module, loss),
        "gather-outside-fsdp2": lambda: route_loss(model, inner, loss, gather=[nn.Linear(2, 2)]),
        "gather-by-name": lambda: route_loss(model, inner, loss, gather="lm_head"),
        "no-tensor-find-unused": lambda: route_loss(model, inner, lambda: _Holder(loss())),
        "detached-find-unused": lambda: route_loss(model, inner, lambda: loss().detach()),
        "async-fn": lambda: route_loss(model, inner, async_loss),
        "generator-fn": lambda: route_loss(model, inner, generator_loss),
        "async-fn-fsdp2": lambda: route_loss(model, inner, async_loss),
    }
    before = snapshot(wrapped)
    raised: Exception | None = None
    try:
        calls[case]()
    except Exception as caught:
        raised = caught
    said = f"{type(raised).__name__}: {raised}" if raised is not None else "no error"
    assert type(raised).__name__ == error and words in str(raised), f"{case}: wanted {error} saying {words!r}: {said}"
    mro = [c.__name__ for c in type(raised).__mro__]
    assert "WrapperRouteError" in mro and ("TypeError" in mro or "ValueError" in mro), f"{case}: {said} is {mro}"
    assert fix is None or fix in str(raised), f"{case}: the message does not name the fix {fix!r}: {said}"
    left = changed(before, snapshot(wrapped))
    assert not left, f"{case}: state left behind: {left}"
    truth_step(wrapped, reference, 0, after=case)  # the same wrapper, next step


def no_grad_evaluation(wrapper: str, opts: dict[str, Any]) -> None:
    """A routed loss under torch.no_grad() (an evaluation loss): FSDP1/FSDP2 still unshard (the loss value equals
    a single process's), DDP arms nothing, the wrapper is back to its layout, and the next grad step is exact."""
    case = LOSSES["fused_ce"]
    wrapped, reference = build(wrapper, opts)
    batch = make_batch(case, CONFIG, dist.get_rank(), 0, 0)
    before = snapshot(wrapped)
    with torch.no_grad():
        value = route_loss(wrapped.model, wrapped.inner, case.compute, wrapped.inner, batch, {})
        expected = case.compute(reference.model, batch, {})  # type: ignore[arg-type]
    diff = float((value - expected).abs())
    assert diff <= REFERENCE_TOLERANCE, f"the no_grad loss is {diff:.3g} from one process's (> {REFERENCE_TOLERANCE})"
    assert not value.requires_grad, "the loss computed under no_grad requires grad"
    left = changed(before, snapshot(wrapped))
    assert not left, f"the no_grad call left state behind (FSDP resharded, no forward, no hook): {left}"
    truth_step(wrapped, reference, 0, after="a no_grad routed loss")


def eval_mode() -> None:
    """A model in eval() mode (FSDP2): routed, exact, and every module's mode untouched."""
    wrapped, reference = build("fsdp2", {"groups": "layers"})
    wrapped.model.eval()
    reference.model.eval()
    modes_before = [m.training for m in wrapped.model.modules()]
    truth_step(wrapped, reference, 0, after="model.eval()")
    modes = [m.training for m in wrapped.model.modules()]
    assert modes == modes_before, f"the modules' training flags were {modes_before}, are {modes}"


def inside_own_forward() -> None:
    """route_loss called from inside the wrapper's own forward (DDP): fn runs directly, the forward is entered
    once, the gradients exact."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    case = LOSSES["fused_ce"]
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref_model = build_model(CONFIG), build_model(CONFIG)
    ddp = DDP(model)
    calls: list[int] = []
    ddp.register_forward_pre_hook(lambda module, args: calls.append(1))
    original = type(model).forward
    batches = [make_batch(case, CONFIG, r, 0, 0) for r in range(world)]

    def routing_forward(self: Any, input_ids: torch.Tensor) -> torch.Tensor:
        # a model whose own forward routes its loss (what a library-wrapped model might do)
        return route_loss(ddp, self, lambda: (original(self, input_ids) @ self.lm_head.weight.t()).sum())

    model.forward = routing_forward.__get__(model)  # type: ignore[method-assign]
    ddp(batches[rank]["input_ids"]).backward()
    del model.forward
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    differ, _ = differing_across_ranks(grads)
    ref_loss = sum((original(ref_model, b["input_ids"]) @ ref_model.lm_head.weight.t()).sum() for b in batches)
    (ref_loss / world).backward()  # type: ignore[operator]
    ref_diff = max(float((grads[n] - p.grad).abs().max()) for n, p in ref_model.named_parameters())
    assert len(calls) == 1, f"the wrapper's forward was entered {len(calls)} times"
    assert differ == 0, f"{differ} of {len(grads)} parameters' gradients differ across ranks"
    assert ref_diff <= REFERENCE_TOLERANCE, f"gradients {ref_diff:.3g} from one process's (> {REFERENCE_TOLERANCE})"
