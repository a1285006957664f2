"""Where the operands live: the head's slice of the vocabulary (and the bias's, sliced alike), hidden states
sharded on tokens gathered and the per-token results given back sharded the same way, and the checks of every
operand, the targets' values included."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..adapters.fsdp2 import is_sharded_param
from ..errors import RouteTypeError, RouteValueError


@dataclass(frozen=True)
class Shard:
    """This rank's slice of the vocabulary: rows ``offset .. offset + local.shape[0]`` of the head, and the group
    holding the other slices (None: the whole head is here)."""

    local: torch.Tensor
    offset: int
    vocab: int
    group: Any
    placements: Any = None
    mesh: Any = None


def vocab_shard(weight: torch.Tensor) -> Shard:
    """The local slice of a head weight: the tensor itself, or a DTensor's local part (differentiable back to
    the DTensor) with where it sits in the vocabulary."""
    placements = getattr(weight, "placements", None)
    mesh = getattr(weight, "device_mesh", None)
    if placements is None or mesh is None:
        return Shard(weight, 0, weight.shape[0], None)
    if is_sharded_param(weight):
        raise RouteValueError(
            f"weight is FSDP2's sharded parameter ({placements} on {mesh}: its shard over the data-parallel ranks, "
            "not a tensor-parallel slice of the vocabulary), read outside its FSDP unit's forward, where its "
            "gradient would skip FSDP's reduce-scatter. Compute the loss inside the wrapper's forward, where FSDP "
            "gathers it: wrapperroute.route_loss(model, unwrapped, loss_fn, ..., gather=[the head module])"
        )
    dims = [d for d, p in enumerate(placements) if not p.is_replicate()]
    if any(placements[d].is_partial() for d in dims):
        raise RouteValueError("weight is a DTensor with a Partial placement: reduce it before reading it as a head")
    if any(getattr(placements[d], "dim", None) != 0 for d in dims):
        raise RouteValueError(
            f"weight is sharded on its hidden dimension ({placements}): a vocabulary-parallel loss needs the head "
            "sharded on the vocabulary (dimension 0, ColwiseParallel), or whole"
        )
    if len(dims) > 1:
        raise RouteValueError(
            f"weight is sharded over {len(dims)} mesh dimensions ({placements} on {mesh}): only the tensor-parallel "
            "one may remain. Inside the data-parallel wrapper's forward (wrapperroute.route_loss) FSDP gathers its "
            "own dimension: call the loss there."
        )
    local = weight.to_local()  # type: ignore[attr-defined]
    if not dims:
        return Shard(local, 0, weight.shape[0], None, placements, mesh)
    dim = dims[0]
    ranks, coordinate, vocab = mesh.size(dim), mesh.get_local_rank(dim), weight.shape[0]
    # Shard(0) splits as torch.chunk does: ceil(V / ranks) rows each, the last ones shorter or empty
    rows = -(-vocab // ranks)
    offset = min(coordinate * rows, vocab)
    if local.shape[0] != max(0, min(rows, vocab - offset)):
        raise RouteValueError(
            f"weight's local shard has {local.shape[0]} rows where an even Shard(0) split of {vocab} over {ranks} "
            f"ranks gives {max(0, min(rows, vocab - offset))}: an uneven or strided sharding is not supported"
        )
    return Shard(local, offset, vocab, mesh.get_group(dim), placements, mesh)


def bias_slice(bias: torch.Tensor | None, shard: Shard) -> torch.Tensor | None:
    """The bias's rows matching the head's slice: a plain ``(V,)`` tensor beside a plain head, or a DTensor laid
    out as the head is (same mesh, same placements) beside a DTensor head."""
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor):
        raise RouteTypeError(f"bias must be a tensor or None, got {type(bias).__name__}")
    if bias.dim() != 1 or bias.shape[0] != shard.vocab:
        raise RouteValueError(f"bias must be the head's (V,) = ({shard.vocab},) vector, got {tuple(bias.shape)}")
    if not bias.is_floating_point():
        raise RouteTypeError(f"bias must be a floating-point tensor, got {bias.dtype}")
    placements = getattr(bias, "placements", None)
    if shard.group is None and placements is None:
        return bias
    if placements is None or tuple(placements) != tuple(shard.placements or ()) or bias.device_mesh != shard.mesh:  # type: ignore[attr-defined]
        raise RouteValueError(
            f"bias ({placements or 'a plain tensor'}) must be laid out as the head is "
            f"({shard.placements or 'a plain tensor'}): a DTensor on the head's mesh with its placements "
            "(ColwiseParallel shards both), or plain beside a plain head"
        )
    local: torch.Tensor = bias.to_local()  # type: ignore[attr-defined]
    return local


def local_whole(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """A plain tensor as it is; a replicated DTensor's local copy."""
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return tensor
    if not all(p.is_replicate() for p in placements):
        raise RouteValueError(f"{name} must be whole on every tensor-parallel rank (Replicate), got {placements}")
    local: torch.Tensor = tensor.to_local()  # type: ignore[attr-defined]
    return local


@dataclass(frozen=True)
class Tokens:
    """How the hidden states came: whole (``mesh`` None), or a DTensor sharded on tokens over ``mesh`` with
    ``placements``, whose per-token results go back sharded the same way."""

    mesh: Any = None
    placements: Any = None

    def give_back(self, per_token: torch.Tensor) -> torch.Tensor:
        """Per-token results as the caller's hidden states were laid out: a DTensor sharded on tokens like them
        (each rank its own rows; the backward gathers the incoming gradients, which every vocabulary slice needs
        for every token), or the plain tensor."""
        if self.mesh is None:
            return per_token
        from torch.distributed.tensor import DTensor, Replicate

        whole = DTensor.from_local(per_token, self.mesh, [Replicate()] * len(self.placements), run_check=False)
        sharded: torch.Tensor = whole.redistribute(self.mesh, self.placements)
        return sharded


def token_layout(tensor: torch.Tensor, name: str) -> tuple[torch.Tensor, Tokens]:
    """``tensor`` whole on this rank: a plain tensor as it is, a replicated DTensor's local copy, a DTensor
    sharded on tokens (sequence parallelism: ``Shard(0)`` of the flattened ``(N, ...)``) gathered
    (``full_tensor()``, differentiable: its backward keeps this rank's rows of the gradient)."""
    placements = getattr(tensor, "placements", None)
    if placements is None or all(p.is_replicate() for p in placements):
        return local_whole(tensor, name), Tokens()
    if not all(p.is_replicate() or getattr(p, "dim", None) == 0 for p in placements):
        raise RouteValueError(
            f"{name} is a DTensor {tuple(placements)}: only Replicate, or Shard(0) on tokens (sequence "
            f"parallelism; flatten batch and sequence before sharding) is taken"
        )
    whole: torch.Tensor = tensor.full_tensor()  # type: ignore[attr-defined]
    return whole, Tokens(tensor.device_mesh, tuple(placements))  # type: ignore[attr-defined]


def check_shapes(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> None:
    for name, value in (("hidden", hidden), ("weight", weight), ("target", target)):
        if not isinstance(value, torch.Tensor):
            raise RouteTypeError(f"{name} must be a tensor, got {type(value).__name__}")
    if weight.dim() != 2:
        hint = (" (a ZeRO-3 partitioned parameter read outside the engine's forward has 0 elements: compute the loss "
                "inside it, wrapperroute.route_loss)") if weight.numel() == 0 else ""  # fmt: skip
        raise RouteValueError(f"weight must be the head's (V, H) matrix, got shape {tuple(weight.shape)}{hint}")
    if hidden.dim() != 2 or hidden.shape[1] != weight.shape[-1]:
        raise RouteValueError(
            f"hidden must be (N, H) with H = weight.shape[1] = {weight.shape[-1]}, got {tuple(hidden.shape)}; "
            "flatten batch and sequence first (hidden.flatten(0, 1))"
        )
    if target.shape != hidden.shape[:1]:
        sharded = " (hidden is sharded on tokens: N counts every rank's rows; pass the whole targets, or a DTensor " \
                  "sharded as hidden is)" if getattr(hidden, "placements", None) is not None else ""  # fmt: skip
        raise RouteValueError(f"target must be (N,) = ({hidden.shape[0]},), got {tuple(target.shape)}{sharded}")
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise RouteTypeError(f"target must hold integer token ids (torch.long, int32...), got {target.dtype}")


def check_targets(target: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Every target a token id of the vocabulary, ``[0, V)``, or ``ignore_index``: one pass over the targets and
    one reduction (their minimum and maximum, ignored ones counted as 0), then two numbers read on the host,
    which waits for the device (a CUDA synchronisation). Every tensor-parallel rank holds the same targets, so
    every rank raises alike, before any collective."""
    if target.numel() == 0:
        return
    counted = target.masked_fill(target == ignore_index, 0)
    low, high = torch.stack(torch.aminmax(counted)).tolist()
    if low >= 0 and high < vocab:
        return
    position = int(((counted < 0) | (counted >= vocab)).nonzero()[0, 0])
    raise RouteValueError(
        f"target[{position}] = {int(target[position])} is not a token id of the head's vocabulary [0, {vocab}) nor "
        f"ignore_index ({ignore_index}): mask padding and prompt tokens with ignore_index"
    )
