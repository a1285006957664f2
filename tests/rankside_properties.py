"""Rank bodies for tests/test_properties.py: random module trees through real wrappers, gradient truth asserted
for every example (module level: the pool pickles them by reference)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from wrapperroute import detect, route_loss
from wrapperroute.check.cell import REFERENCE_TOLERANCE, differing_across_ranks, max_grad_diff
from wrapperroute.check.wrappers import WRAPPERS, build_none


class Level(nn.Module):
    """One level of a random tree: a linear map, a buffer scaling it, and optionally a nested sub-level."""

    def __init__(self, width_in: int, width_out: int, depth: int, buffers: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(width_in, width_out)
        self.sub = Level(width_out, width_out, depth - 1, buffers) if depth > 1 else None
        if buffers:  # one persistent, one not: DDP broadcasts them, FSDP leaves them replicated
            self.register_buffer("scale", torch.linspace(0.5, 1.5, width_out))
            self.register_buffer("shift", torch.full((width_out,), 0.1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        if hasattr(self, "scale"):
            y = y * self.scale + self.shift
        return y + self.sub(y) if self.sub is not None else y


class RandomTree(nn.Module):
    """``embed`` -> ``blocks`` (a random tree of levels) -> hidden; the loss reads ``lm_head.weight`` directly.
    The names match the FSDP builders' layouts (``blocks`` and ``lm_head`` as their own groups/units)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        dim, widths = spec["dim"], list(spec["widths"])
        if spec["tied"]:  # lm_head.weight (dim x last) shares embed.weight (first x dim)
            widths[0] = widths[-1] = dim
        self.embed = nn.Linear(dim, widths[0])
        self.blocks = nn.ModuleList(
            Level(a, b, spec["depth"], spec["buffers"]) for a, b in zip(widths, widths[1:] + widths[-1:], strict=True)
        )
        self.lm_head = nn.Linear(widths[-1], dim, bias=False)
        if spec["tied"]:
            self.lm_head.weight = self.embed.weight
        if spec["unused"]:
            self.unused = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.embed(x))
        for block in self.blocks:
            x = block(x)
        return x


def _tree_batch(spec: dict[str, Any], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(spec["seed"] * 1009 + rank)
    rows = spec["sizes"][rank]
    x = torch.randn(rows, spec["dim"], generator=generator)
    return x, torch.randint(0, spec["dim"], (rows,), generator=generator)


def _tree_loss(model: Any, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # written out: one row of logits per example (2-D), not fused_cross_entropy's (batch, seq) layout
    logits = model(x) @ model.lm_head.weight.t()  # the fused-loss pattern: the weight, not the module
    return torch.nn.functional.cross_entropy(logits, labels)  # this rank's mean over its own rows


def tree_truth(spec: dict[str, Any]) -> None:
    """Gradient truth for one random tree, wrapper, per-rank batch sizes and nesting of route_loss calls: every
    gradient the same on every rank and within REFERENCE_TOLERANCE of the reference's, no forward left.

    Reference (DDP's and FSDP's promise): gradients are averaged over ranks, each rank's loss being the mean
    over its own rows, so a single process computes mean over ranks of per-rank mean losses, not the mean over
    all rows (the two differ when batch sizes differ)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.random.fork_rng():
        torch.manual_seed(spec["seed"])
        model = RandomTree(spec)
    reference = build_none(_clone_tree(model, spec), {})
    opts = dict(spec["opts"])
    if spec["wrapper"] in ("ddp", "replicate") and spec["unused"]:
        opts["find_unused_parameters"] = True
    if spec["wrapper"] == "fabric_ddp" and spec["unused"]:
        opts["strategy"] = "ddp_find_unused_parameters_true"
    wrapped = WRAPPERS[spec["wrapper"]].build(model, opts)
    inner: Any = wrapped.inner
    x, labels = _tree_batch(spec, rank)

    def nest(level: int) -> torch.Tensor:
        if level == 0:
            return _tree_loss(inner, x, labels)
        return route_loss(wrapped.model, inner, nest, level - 1, mode=spec["mode"]) * 1.0

    loss = route_loss(wrapped.model, inner, nest, spec["nest"], mode=spec["mode"])
    wrapped.backward(loss)
    grads = wrapped.full_grads()
    differ, _ = differing_across_ranks(grads)
    ref_loss = sum(_tree_loss(reference.model, *_tree_batch(spec, r)) for r in range(world)) / world
    ref_loss.backward()  # type: ignore[union-attr]
    ref = reference.full_grads()
    target = detect(wrapped.model)
    forward_left = "forward" in target.adapter.redirect_target(target.wrapper).__dict__  # type: ignore[union-attr,arg-type]
    ref_diff = max_grad_diff(grads, ref)
    assert grads, f"no gradient to compare: {spec}"
    assert not forward_left, f"an instance forward left on the wrapper's target: {spec}"
    assert differ == 0, f"{differ} of {len(grads)} parameters' gradients differ across ranks: {spec}"
    assert ref_diff <= REFERENCE_TOLERANCE, f"gradients {ref_diff:.3g} from the reference's: {spec}"


def _clone_tree(model: nn.Module, spec: dict[str, Any]) -> nn.Module:
    clone = RandomTree(spec)
    clone.load_state_dict(model.state_dict())
    return clone


def tree_truth_many(specs: list[dict[str, Any]]) -> None:
    for spec in specs:
        tree_truth(spec)
