"""Ctrl-C anywhere in a routed call leaves no state behind (a notebook user interrupts a step and trains on).

Every point of a routed call where CPython could raise a pending KeyboardInterrupt (tests/interrupt_points.py)
is interrupted in turn; after each: the interrupt reached the caller, no ``forward`` attribute or hook dict is
left changed on any module, no lock is held, no call counted in flight, and the next routed step runs (and,
for DDP, is exact). The same on 2 ranks for every wrapper, judged by gradient truth: tests/test_reliability.py.

One process, one real gloo rank (DDP, FSDP1, FSDP2 on a one-rank group): the state checked is per process.
The next step's gradients are compared for DDP only. FSDP's own state after an abandoned forward differs from
a fresh step natively, routed or not (measured here: FSDP2, a no_grad forward then a step changes the root's
gradients; FSDP1 with use_orig_params, a forward that raised leaves the root's original parameters without
gradients for one step), so for FSDP the next step must run, and its exactness after a failed loss is the
multi-rank fault tests' job (tests/test_reliability.py, flat-parameter gradients on 2 ranks).
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from interrupt_points import count_points, interrupt_at
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import wrapperroute as wr
from wrapperroute._routing.state import routing_state

_MISSING = object()
CASES = ["ddp", "ddp-find_unused", "ddp-isolate", "ddp-loss_calls_wrapper", "ddp-instance_forward", "fsdp1", "fsdp2"]


class _Case:
    """A wrapped model on the one-rank group and a routed loss exercising one path of the routed call."""

    def __init__(self, name: str) -> None:
        torch.manual_seed(0)
        self.inner: nn.Module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.x = torch.randn(3, 4)
        self.options: dict[str, Any] = {"mode": "isolate"} if name == "ddp-isolate" else {}
        head = self.inner[2]
        if name == "ddp-instance_forward":  # what accelerate's mixed precision leaves: an instance forward to keep
            self.inner.forward = types.MethodType(type(self.inner).forward, self.inner)
        if name.startswith("ddp"):
            self.model: nn.Module = DDP(self.inner, find_unused_parameters=name == "ddp-find_unused")
        elif name == "fsdp1":  # the head its own unit: the loss reads its weight through the nested unit
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            self.inner[2] = FSDP(head, device_id=torch.device("cpu"), use_orig_params=True)
            self.model = FSDP(self.inner, device_id=torch.device("cpu"), use_orig_params=True)
            self.inner = self.model.module
        else:  # fsdp2: the root is the model; the head its own group, gathered for the loss
            from torch.distributed.device_mesh import init_device_mesh

            from wrapperroute.check.wrap_fsdp import fsdp2_api

            fully_shard = fsdp2_api().fully_shard

            mesh = init_device_mesh("cpu", (1,))
            fully_shard(head, mesh=mesh)
            self.model = fully_shard(self.inner, mesh=mesh)
            self.options["gather"] = [head]
        self.head = head
        inner, x = self.inner, self.x
        if name == "ddp-loss_calls_wrapper":  # inside the loss, the wrapper is a plain call (its passthrough)
            self.loss = lambda: self.model(x).square().sum()
        else:  # reads the head's weight directly, as a fused loss does
            self.loss = lambda: (torch.tanh(inner[0](x)) @ head.weight.t() + head.bias).square().sum()

    def step(self) -> Any:
        return wr.route_loss(self.model, self.inner, self.loss, **self.options)

    def grads(self) -> dict[str, torch.Tensor]:
        for p in self.model.parameters():
            p.grad = None
        self.step().backward()
        return {name: p.grad.clone() for name, p in self.model.named_parameters() if p.grad is not None}

    def forwards(self) -> list[object]:
        """Every module's instance forward and, under FSDP2, its hook dicts: all must come back untouched."""
        return [
            value
            for module in self.model.modules()
            for value in (module.__dict__.get("forward", _MISSING), *(module.__dict__.get(n) for n in HOOK_DICTS))
        ]


HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("grad", [True, False], ids=["train", "no_grad"])
def test_interrupt_anywhere_leaves_no_state(one_rank: None, grad: bool, case: str) -> None:
    wrapped = _Case(case)
    reference = wrapped.grads()  # also plans the model: later calls take the step's own path
    zero = [name for name, g in reference.items() if not g.abs().sum() > 0]
    assert reference and not zero, f"{case}: no gradient, or all-zero ones: {zero}"
    before = wrapped.forwards()

    def step() -> Any:
        with torch.set_grad_enabled(grad):
            return wrapped.step()

    points = count_points(step)
    assert points > 30, points  # the tracer sees the routed call's own code
    clean = routing_state()
    assert not (clean.in_flight or clean.grad_in_flight or clean.passthroughs), clean
    leftovers = []
    for point in range(1, points + 1):
        interrupted, where = interrupt_at(point, step)
        now = wrapped.forwards()
        left = [
            what
            for what, bad in (
                ("the interrupt was swallowed", not interrupted),
                ("a forward or hook dict not put back", any(a is not b for a, b in zip(now, before, strict=True))),
                ("a lock held", routing_state().locks_held),
                ("a call still counted in flight", routing_state().in_flight),
                ("a graph-recording call still counted", routing_state().grad_in_flight),
                ("this thread still marked as routing", routing_state().routing_here),
            )
            if bad
        ]
        if left:
            leftovers.append((point, where, left))
            break  # the state is broken: later points would only repeat it
        after = wrapped.grads()  # runs: a broken wrapper state raises here
        if case.startswith("ddp") and (
            after.keys() != reference.keys() or any(not torch.equal(after[k], reference[k]) for k in reference)
        ):
            leftovers.append((point, where, ["the next routed step's gradients differ"]))
            break
    assert not leftovers, leftovers
