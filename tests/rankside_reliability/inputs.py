"""Rank bodies for tests/test_reliability.py: bad input on real wrappers, and legitimate odd uses."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rankside_reliability import CONFIG, build, snapshot, truth_step
from wrapperroute import route_loss
from wrapperroute.check.cell import differing_across_ranks
from wrapperroute.check.losses import LOSSES, make_batch
from wrapperroute.check.models import build_model
from wrapperroute.check.wrappers import Wrapped


class _Holder:
    """A loss inside an object DDP's output walk cannot see."""

    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss


def bad_input_cases() -> dict[str, dict[str, Any]]:
    """Mistakes made against a real DDP / FSDP2 model. For each: the exception (type, message), whether the
    wrapper is exactly as before (forward attributes, hook counts, layout), and a routed step on the same
    model afterwards (gradient truth)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    results: dict[str, dict[str, Any]] = {}
    ddp, ddp_ref = build("ddp", {"find_unused_parameters": True})
    fsdp2, fsdp2_ref = build("fsdp2", {"groups": "layers"})
    inner: Any = ddp.inner
    ids = make_batch(LOSSES["fused_ce"], CONFIG, dist.get_rank(), 0, 0)["input_ids"]
    other = DDP(build_model(CONFIG))

    def loss() -> torch.Tensor:
        return (inner(ids) @ inner.lm_head.weight.t()).logsumexp(-1).mean()

    async def async_loss() -> torch.Tensor:
        return loss()

    def generator_loss() -> Any:
        yield loss()

    cases: dict[str, tuple[Wrapped, Wrapped, Any]] = {
        "unwrapped-is-the-wrapper": (ddp, ddp_ref, lambda: route_loss(ddp.model, ddp.model, loss)),
        "unwrapped-of-another-model": (ddp, ddp_ref, lambda: route_loss(ddp.model, other.module, loss)),
        "gather-outside-fsdp2": (
            fsdp2, fsdp2_ref, lambda: route_loss(fsdp2.model, fsdp2.inner, loss, gather=[nn.Linear(2, 2)])
        ),
        "gather-by-name": (ddp, ddp_ref, lambda: route_loss(ddp.model, inner, loss, gather="lm_head")),
        "no-tensor-find-unused": (ddp, ddp_ref, lambda: route_loss(ddp.model, inner, lambda: _Holder(loss()))),
        "detached-find-unused": (ddp, ddp_ref, lambda: route_loss(ddp.model, inner, lambda: loss().detach())),
        "async-fn": (ddp, ddp_ref, lambda: route_loss(ddp.model, inner, async_loss)),
        "generator-fn": (ddp, ddp_ref, lambda: route_loss(ddp.model, inner, generator_loss)),
        "async-fn-fsdp2": (fsdp2, fsdp2_ref, lambda: route_loss(fsdp2.model, fsdp2.inner, async_loss)),
    }
    step = {"ddp": 0, "fsdp2": 0}
    for name, (wrapped, reference, call) in cases.items():
        before = snapshot(wrapped)
        entry: dict[str, Any] = {"error": None, "message": ""}
        try:
            call()
        except Exception as error:
            entry.update(error=type(error).__name__, message=str(error), mro=[c.__name__ for c in type(error).__mro__])
        entry["clean"] = snapshot(wrapped) == before
        kind = "ddp" if wrapped is ddp else "fsdp2"
        entry["after"] = truth_step(wrapped, reference, step[kind])
        step[kind] += 1
        results[name] = entry
    return results


def legit_cases() -> dict[str, dict[str, Any]]:
    """Uses that look odd but are legitimate, proved to route correctly:
    - under torch.no_grad() (an evaluation loss): FSDP1/FSDP2 still unshard (the loss value equals a single
      process's), DDP arms nothing, every wrapper is back to its layout, and the next grad step is exact;
    - a model in eval() mode: routed, modes untouched, gradients exact;
    - route_loss called from inside the wrapper's own forward: fn runs directly, the forward is entered once."""
    case = LOSSES["fused_ce"]
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, dict[str, Any]] = {}
    for wrapper, opts in (("ddp", {}), ("fsdp1", {"lm_head_unit": True}), ("fsdp2", {"groups": "layers"})):
        wrapped, reference = build(wrapper, opts)
        batch = make_batch(case, CONFIG, rank, 0, 0)
        before = snapshot(wrapped)
        with torch.no_grad():
            value = route_loss(wrapped.model, wrapped.inner, case.compute, wrapped.inner, batch, {})
            expected = case.compute(reference.model, batch, {})  # type: ignore[arg-type]
        out[f"no_grad-{wrapper}"] = {
            "value_diff": float((value - expected).abs()),
            "requires_grad": value.requires_grad,
            "clean": snapshot(wrapped) == before,
            "after": truth_step(wrapped, reference, 0),
        }
    wrapped, reference = build("fsdp2", {"groups": "layers"})
    wrapped.model.eval()
    reference.model.eval()
    modes_before = [m.training for m in wrapped.model.modules()]
    facts = truth_step(wrapped, reference, 0)
    out["eval-mode-fsdp2"] = {**facts, "modes_kept": [m.training for m in wrapped.model.modules()] == modes_before}

    from torch.nn.parallel import DistributedDataParallel as DDP

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
    out["inside-own-forward-ddp"] = {"forward_calls": len(calls), "differ": differ, "max_ref_diff": ref_diff}
    return out
