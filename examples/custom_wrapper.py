"""Teach wrapperroute a data-parallel wrapper of your own: routed exactly, audited, counted by ``token_divisor``.

``AllReduceDP`` is data parallelism written by hand, as trainers do: its forward arms one all-reduce of each
gradient (their mean over the ranks), run in the backward that follows. A fused loss computed on the unwrapped
model never runs that forward, so each rank silently keeps its own gradients. ``AllReduceDPAdapter`` tells
wrapperroute what the wrapper is (three methods and two answers), and ``register_adapter`` makes it one of the
wrappers ``route_loss``, ``token_divisor``, ``check_grad_sync``, ``guard`` and ``wrapperroute audit`` know.

Run on 2 CPU ranks, no GPU, nothing downloaded::

    python examples/custom_wrapper.py                                       # spawns 2 gloo ranks itself
    torchrun --nproc-per-node 2 examples/custom_wrapper.py [--unrouted]
    torchrun --nproc-per-node 2 -m wrapperroute audit examples/custom_wrapper.py --unrouted   # DESYNC

Prints, per step, how many parameters' gradients differ across ranks: 0 routed, every one unrouted.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from wrapperroute import check_grad_sync, route_loss, token_divisor
from wrapperroute.adapters import ArmsInForward, Averaging, Replica, Routing, Topology, register_adapter, replicated
from wrapperroute.check.models import TinyCausalLM, TinyConfig, build_model


class AllReduceDP(nn.Module):
    """Data parallelism by hand: each grad-enabled forward arms one all-reduce of every trainable parameter's
    gradient, run as the backward accumulates it, then divided by the number of ranks. ``sync = False``
    accumulates locally instead (a ``no_sync`` of its own). A backward with no forward before it stays local."""

    def __init__(self, module: nn.Module, group: Any = None) -> None:
        super().__init__()
        self.module = module
        self.group = group
        self.sync = True
        self._armed: set[int] = set()
        for param in module.parameters():
            dist.broadcast(param.data, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._reduce)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.sync and torch.is_grad_enabled():
            self._armed = {id(param) for param in self.module.parameters() if param.requires_grad}
        return self.module(*args, **kwargs)

    def _reduce(self, param: torch.Tensor) -> None:
        if id(param) in self._armed and param.grad is not None:
            self._armed.discard(id(param))
            dist.all_reduce(param.grad, group=self.group)
            param.grad.div_(dist.get_world_size(self.group))


class AllReduceDPAdapter(Routing, Topology, ArmsInForward):
    """What wrapperroute needs to know about ``AllReduceDP``. Routing: its forward calls ``module`` (the default
    ``redirect_target``, ``peel``), so the loss runs there. Topology: every rank of its group holds a copy of
    every parameter, and the gradients are averaged over that group. ``ArmsInForward``: its forward arms the
    reduction, and ``sync`` says whether the next backward reduces (what ``guard`` watches)."""

    kind = "allreduce_dp"

    def claims(self, module: nn.Module) -> bool:
        return isinstance(module, AllReduceDP)

    def peel(self, module: nn.Module) -> nn.Module:
        inner: nn.Module = module.module  # type: ignore[assignment]
        return inner

    def replicas(self, wrapper: nn.Module) -> list[Replica]:
        return replicated(self.peel(wrapper), _ranks(wrapper.group))

    def averaging(self, wrapper: nn.Module) -> Averaging:
        ranks = _ranks(wrapper.group)
        return Averaging(ranks, wrapper.group, float(len(ranks)))

    def step_ranks(self, wrapper: nn.Module) -> tuple[int, ...]:
        return _ranks(wrapper.group)

    def syncs_gradients(self, wrapper: nn.Module) -> bool:
        return bool(wrapper.sync)


def _ranks(group: Any) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))


register_adapter(AllReduceDPAdapter())


def summed_loss(model: TinyCausalLM, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the valid tokens, from the head's weight (the pattern that skips the forward)."""
    logits = model(ids) @ model.lm_head.weight.t()
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")


def batch(config: TinyConfig, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: 4 sequences, a different number of masked tokens on every rank."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, config.vocab, (4, config.seq), generator=generator)
    labels = torch.roll(ids, -1, 1)
    labels[:, config.seq - 1 - rank % config.seq :] = -100  # uneven valid tokens across ranks
    return ids, labels


def train(routed: bool, steps: int = 3) -> dict[str, Any]:
    """``steps`` optimizer steps; the loss over every valid token of the global batch when routed. Returns the
    number of parameters whose gradients differ across ranks at each step, the divisors, and the first step's
    gradients."""
    config = TinyConfig()
    model = build_model(config)
    wrapped = AllReduceDP(model)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    differing: list[int] = []
    divisors: list[float] = []
    first: dict[str, torch.Tensor] = {}
    for step in range(steps):
        ids, labels = batch(config, dist.get_rank(), step)
        divisor = token_divisor(wrapped, int((labels != -100).sum()))  # the global count over the ranks averaged
        if routed:
            # wrapped(...) runs, so the all-reduce is armed; the loss sees the unwrapped model.
            loss = route_loss(wrapped, model, summed_loss, model, ids, labels) / divisor
        else:
            loss = summed_loss(model, ids, labels) / divisor  # AllReduceDP.forward never runs: nothing reduced
        loss.backward()
        differing.append(check_grad_sync(wrapped).differing)
        divisors.append(float(divisor))
        if step == 0:
            first = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"differing": differing, "divisors": divisors, "first_grads": first}


def main(unrouted: bool = False) -> dict[str, Any]:
    result = train(routed=not unrouted)
    if dist.get_rank() == 0:
        params = sum(1 for _ in build_model(TinyConfig()).parameters())
        print(f"{'unrouted' if unrouted else 'routed'}: parameters differing across ranks per step "
              f"(of {params}): {result['differing']}", flush=True)  # fmt: skip
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--unrouted", action="store_true", help="compute the loss on the unwrapped model")
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun, or under wrapperroute audit
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        main(args.unrouted)
        dist.destroy_process_group()
    else:
        from wrapperroute.ranks import RankPool

        with RankPool(2) as pool:
            results = pool.run(main, args.unrouted)
        assert all(count == 0 for count in results[0]["differing"]) != args.unrouted, results[0]["differing"]
