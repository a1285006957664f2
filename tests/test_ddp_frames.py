"""'This thread is inside DDP's forward' is read from the stack: matched by ``_run_ddp_forward``'s name and its
``self``, so a DDP subclass that reimplements it is seen, and a loss routed from inside a compiled model's
forward is seen too (route_loss runs eagerly there, between Dynamo's graphs). One gloo rank, this process."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from wrapperroute import route_loss


class RoutesInside(torch.nn.Module):
    """A model whose forward routes its own loss (Lightning's ``training_step`` pattern): route_loss must see it
    is inside the wrapper's forward already and call the loss plainly."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.wrapper: torch.nn.Module | None = None
        self.saw_base_frame: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def loss() -> torch.Tensor:
            base = DDP._run_ddp_forward.__code__
            frame, seen = sys._getframe(), False
            while frame is not None:
                seen = seen or frame.f_code is base
                frame = frame.f_back  # type: ignore[assignment]
            self.saw_base_frame.append(seen)
            return self.lin(x).sum()

        return route_loss(self.wrapper, self, loss)  # type: ignore[arg-type]


class OwnRunForward(DDP):
    """A DDP subclass reimplementing ``_run_ddp_forward`` (not calling DDP's own)."""

    def _run_ddp_forward(self, *inputs: Any, **kwargs: Any) -> Any:
        with self._inside_ddp_forward():
            return self.module(*inputs, **kwargs)


@pytest.fixture
def pre_forwards() -> Iterator[list[int]]:
    """Calls of DDP's ``_pre_forward`` (one per step when the loss is not routed a second time)."""
    original = DDP._pre_forward
    counted = [0]

    def counting(self: DDP, *args: Any, **kwargs: Any) -> Any:
        counted[0] += 1
        return original(self, *args, **kwargs)

    DDP._pre_forward = counting  # type: ignore[method-assign]
    try:
        yield counted
    finally:
        DDP._pre_forward = original  # type: ignore[method-assign]


WRAPS: dict[str, Callable[[torch.nn.Module], torch.nn.Module]] = {
    "ddp": DDP,
    "subclass": OwnRunForward,
    "compiled": lambda inner: torch.compile(DDP(inner)),
}


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_a_loss_routed_from_inside_the_forward_is_called_plainly(
    one_rank: None, pre_forwards: list[int], wrap: str
) -> None:
    torch.manual_seed(0)
    inner = RoutesInside()
    plain = torch.nn.Linear(4, 4)
    plain.load_state_dict(inner.lin.state_dict())
    wrapped = WRAPS[wrap](inner)
    inner.wrapper = wrapped
    for step in range(2):
        x = torch.randn(2, 4)
        wrapped(x).backward()
        plain(x).sum().backward()
        assert pre_forwards[0] == step + 1, "the loss entered DDP's forward a second time"
    grad, expected = inner.lin.weight.grad, plain.weight.grad
    assert grad is not None and expected is not None, f"{wrap}: a gradient is missing: {grad}, {expected}"
    diff = float((grad - expected).abs().max())
    assert torch.allclose(grad, expected, atol=1e-6), f"{wrap}: routed and plain gradients {diff:.3g} apart"
    if wrap == "subclass":  # the premise: DDP's own _run_ddp_forward never ran
        assert inner.saw_base_frame == [False, False], f"DDP's own _run_ddp_forward ran: {inner.saw_base_frame}"
    assert DDP._active_ddp_module is None, f"{wrap}: DDP's forward marker left set"
