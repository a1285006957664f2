"""Rank bodies for tests/test_tensor_parallel.py: every option of wrapperroute.losses on a head sharded on the
vocabulary, with hidden states whole or sharded on tokens, against float64 logits materialised on the whole head
(module level: the pool pickles them by reference). Asserted in each rank, where each difference is computed."""

from __future__ import annotations

from typing import Any

import loss_reference as ref
import torch
import torch.distributed as dist

import wrapperroute as wr
from wrapperroute.losses import linear_cross_entropy, linear_logprobs

ROWS, HIDDEN, VOCAB = 22, 8, 37  # neither divides by 4: uneven token and vocabulary shards


def _rows(total: int, ranks: int, coordinate: int) -> slice:
    """This rank's rows of a Shard(0) split (torch.chunk's: ceil(total / ranks) each, the last ones shorter)."""
    size = -(-total // ranks)
    return slice(min(coordinate * size, total), min((coordinate + 1) * size, total))


def _mesh(tp: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp"))["tp"]


def options_on_a_sharded_head(tp: int, sequence_parallel: bool, cases: list[ref.Case],
                              indices: list[int] | None = None) -> dict[str, float]:  # fmt: skip
    """Each case's values and gradients (hidden states, head, bias) within its tolerance of the truth; returns
    the largest difference seen per dtype. Per-token results on hidden states sharded on tokens must come back
    as DTensors sharded alike, each rank its own rows; their targets whole, or (every other case) sharded
    alike."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = _mesh(tp)
    coordinate = mesh.get_local_rank()
    mine, vocab_rows = _rows(ROWS, tp, coordinate), _rows(VOCAB, tp, coordinate)
    worst = {"float64": 0.0, "float32": 0.0}
    for index, case in zip(indices or range(len(cases)), cases, strict=True):  # index: the case's in ref.CASES
        made = ref.inputs(case, ROWS, HIDDEN, VOCAB, seed=index)
        exact = {name: made[name].detach().double().requires_grad_() if made[name] is not None else None
                 for name in ("hidden", "weight", "bias")}  # fmt: skip
        expected = ref.truth(case, exact["hidden"], exact["weight"], exact["bias"], made["target"])
        leaves = [t for t in exact.values() if t is not None]
        expected_grads = torch.autograd.grad(ref.objective(expected, made),
                                             leaves)  # fmt: skip
        weight = distribute_tensor(made["weight"], mesh, [Shard(0)]).requires_grad_()
        bias = None if made["bias"] is None else distribute_tensor(made["bias"], mesh, [Shard(0)]).requires_grad_()
        hidden = made["hidden"].clone().requires_grad_()
        if sequence_parallel:
            hidden = distribute_tensor(made["hidden"], mesh, [Shard(0)]).requires_grad_()
        target = made["target"]
        if sequence_parallel and index % 2:  # every other case: the targets sharded as the hidden states are
            target = distribute_tensor(target, mesh, [Shard(0)])
        found = ref.ours(case, hidden, weight, bias, target)
        local = {}
        for name, value in found.items():
            if value.dim() and sequence_parallel:
                assert isinstance(value, DTensor) and tuple(value.placements) == (Shard(0),), (case, name, value)
                value = value.to_local()
            local[name] = value
        rows = mine if sequence_parallel else slice(None)
        ref.objective(local, made, rows).backward()
        grads = [hidden.grad.to_local() if sequence_parallel else hidden.grad,  # type: ignore[union-attr]
                 weight.grad.to_local()] + ([] if bias is None else [bias.grad.to_local()])  # type: ignore[union-attr]  # fmt: skip
        differences = {}
        for name, value in local.items():
            truth = expected[name].detach()
            differences[name] = float((value.detach().double() - (truth[rows] if truth.dim() else truth)).abs().max())
        slices = [rows, vocab_rows, vocab_rows]
        for name, ours, theirs, part in zip(("hidden", "weight", "bias"), grads, expected_grads, slices, strict=False):
            assert ours.dtype == made[name].dtype, (case, name, ours.dtype)
            differences[f"{name}.grad"] = float((ours.double() - theirs[part]).abs().max())
        assert max(differences.values()) <= case.tolerance, (f"tp={tp} sp={sequence_parallel} {case}", differences)
        assert expected_grads[1].abs().max() > 0.01, case  # the premise: gradients that can differ
        key = "float32" if case.float32 else "float64"
        worst[key] = max(worst[key], *differences.values())
    return worst


def bad_targets_raise_on_every_rank() -> dict[str, str]:
    """On a head sharded over every rank (the same targets on each): an id past the vocabulary, a negative id
    other than ignore_index, floating-point targets: each raises on every rank with its position and value, and
    the ranks are still in step afterwards (a loss with good targets runs its collectives to the end)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh(dist.get_world_size())
    weight = distribute_tensor(torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(0)), mesh,
                               [Shard(0)]).requires_grad_()  # fmt: skip
    hidden = torch.randn(ROWS, HIDDEN, generator=torch.Generator().manual_seed(1))
    good = torch.arange(ROWS) % VOCAB
    seen = {}
    for name, target, error, words in (
        ("past the vocabulary", good.clone().index_fill_(0, torch.tensor([7]), VOCAB), wr.RouteValueError,
         f"target[7] = {VOCAB} is not a token id of the head's vocabulary [0, {VOCAB})"),
        ("negative", good.clone().index_fill_(0, torch.tensor([4]), -1), wr.RouteValueError,
         "target[4] = -1 is not a token id"),
        ("floating point", good.double(), wr.RouteTypeError, "integer token ids"),
    ):  # fmt: skip
        for loss in (linear_logprobs, linear_cross_entropy):
            try:
                loss(hidden, weight, target)
            except error as raised:
                assert words in str(raised), (name, str(raised))
                seen[f"{name} {loss.__name__}"] = str(raised)
            else:
                raise AssertionError(f"{loss.__name__} took {name} targets")
    after = linear_cross_entropy(hidden, weight, good)
    gathered = [torch.zeros(()) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, after.detach())
    assert all(torch.equal(value, gathered[0]) for value in gathered), gathered
    return seen


def top1_across_shards() -> list[bool]:
    """is_top1 on a head of 10 words split over 2 ranks (words 0-4, 5-9), words 3 and 7 sharing the largest
    logit: the first maximum sits on the other rank for target 7."""
    from torch.distributed.tensor import Shard, distribute_tensor

    weight = torch.full((10, 4), 0.1)
    weight[3, 0] = weight[7, 0] = 5.0
    head = distribute_tensor(weight, _mesh(2), [Shard(0)])
    hidden = torch.eye(4)[[0, 0, 0, 0]]
    found = linear_logprobs(hidden, head, torch.tensor([3, 7, 5, -100]), outputs=("is_top1",))
    result: list[bool] = found["is_top1"].tolist()
    return result
