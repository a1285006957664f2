"""The functorch fallback retries a loss only under a wrapper whose isolation changes something (DDP's forward
marker): under FSDP2 the isolated rerun would be the same call again, so the error is raised as it is.

One process, one real gloo rank: a loss that fails with the graph optimizer's message, counted."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import wrapperroute as wr
from wrapperroute._routing.state import forget_isolated, routing_state


def _failing_once(model: nn.Module, calls: list[int]) -> object:
    def loss() -> torch.Tensor:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("Cannot access storage of TensorWrapper")  # what DDP's graph optimizer raises
        return model(torch.ones(2, 4)).sum()

    return loss


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_fallback_only_where_isolation_changes_something(one_rank: None, wrapper: str) -> None:
    from torch.distributed.fsdp import fully_shard

    model = nn.Linear(4, 4)
    wrapped = DDP(model) if wrapper == "ddp" else fully_shard(model)
    calls: list[int] = []
    loss = _failing_once(model, calls)
    before = routing_state().isolated
    if wrapper == "ddp":  # retried once, isolated, and isolated from now on
        shape = wr.route_loss(wrapped, model, loss).shape  # type: ignore[arg-type]
        assert shape == (), f"the retried loss has shape {tuple(shape)}"
        added = routing_state().isolated - before
        assert len(calls) == 2 and added, f"{len(calls)} calls of the loss, isolated from now on: {added}"
    else:  # raised as it is: one call, nothing recorded
        with pytest.raises(RuntimeError, match="TensorWrapper"):
            wr.route_loss(wrapped, model, loss)  # type: ignore[arg-type]
        after = routing_state().isolated
        assert len(calls) == 1 and after == before, f"{len(calls)} calls of the loss; isolated {before}, now {after}"
    forget_isolated(routing_state().isolated - before)
