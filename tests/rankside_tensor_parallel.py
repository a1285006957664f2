"""Rank bodies for tests/test_tensor_parallel.py, on 4 ranks: a head sharded on the vocabulary (module level: the
pool pickles them by reference)."""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from conftest import REPO

from wrapperroute import check_grad_sync, detect, route_loss
from wrapperroute.check.models import TinyConfig, build_model
from wrapperroute.losses import linear_cross_entropy, linear_logprobs

sys.path.insert(0, str(REPO / "examples"))
import tp_preference

VOCAB, HIDDEN, ROWS = 512, 32, 24  # rows x hidden (the hidden gradient's all-reduce) well under a head shard


def _head(tp: int, requires_grad: bool = True, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """The same (VOCAB, HIDDEN) head on every rank, whole, and as a DTensor sharded on the vocabulary over ``tp``
    ranks of a (dp, tp) mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp"))
    whole = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(seed))
    sharded = distribute_tensor(whole, mesh["tp"], [Shard(0)]).requires_grad_(requires_grad)
    return whole.requires_grad_(requires_grad), sharded, mesh


def collective_sizes(tp: int) -> dict[str, Any]:
    """Every collective the losses run (forward and backward), as the profiler sees them on gloo, in elements;
    and, for the premise, what gathering the head (``full_tensor()``) moves."""
    _, weight, _ = _head(tp)
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(ROWS, HIDDEN, generator=generator, requires_grad=True)
    target = torch.randint(0, VOCAB, (ROWS,), generator=generator)

    def sizes(run: Any) -> list[int]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            run()
        found = [event for event in prof.events() if event.name.startswith("gloo:")]
        return [int(torch.tensor(shape).prod()) for event in found for shape in event.input_shapes if shape]

    shard = weight.to_local().numel()
    assert sizes(lambda: weight.full_tensor()) == [shard]  # the premise: gathering the head moves its shards
    for loss in (lambda: linear_cross_entropy(hidden, weight, target, chunk_size=8).backward(),
                 lambda: linear_logprobs(hidden, weight, target, chunk_size=8).sum().backward()):  # fmt: skip
        moved = sizes(loss)
        assert moved and max(moved) < shard, (moved, shard)
        # per chunk of 8 rows: the rows' maxima, then their sums and target logits; the hidden gradient once
        assert max(moved) == ROWS * HIDDEN, moved
    return {"shard": shard}


def preference_against_liger(tp: int) -> dict[str, Any]:
    """DPO and KTO of examples/tp_preference.py on a head sharded over ``tp`` ranks, against Liger's chunked
    losses on the whole head in one process (every rank computes both on the same batch): the losses and the
    gradients of the hidden states and of the head."""
    from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss, LigerFusedLinearKTOLoss

    whole, sharded, _ = _head(tp)
    ref_whole, ref_sharded, _ = _head(tp, requires_grad=False, seed=5)
    generator = torch.Generator().manual_seed(2)
    batch, seq = 4, 6
    hidden = torch.randn(batch, seq, HIDDEN, generator=generator)
    ref_hidden = torch.randn(batch, seq, HIDDEN, generator=generator)
    target = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    target[0, :2] = -100
    preference = torch.tensor([True, False, True, False])
    found = {}
    for name in ("dpo", "kto"):
        ours_hidden = hidden.clone().requires_grad_()
        theirs_hidden = hidden.clone().requires_grad_()
        sharded.grad = whole.grad = None
        if name == "dpo":
            ours = tp_preference.dpo_loss(ours_hidden, sharded, target, ref_hidden, ref_sharded)
            theirs = LigerFusedLinearDPOLoss(beta=0.1, compiled=False)(
                whole, theirs_hidden, target, ref_input=ref_hidden, ref_weight=ref_whole)[0]  # fmt: skip
        else:
            ours = tp_preference.kto_loss(ours_hidden, sharded, target, preference, ref_hidden, ref_sharded)
            theirs = LigerFusedLinearKTOLoss(beta=0.1, compiled=False, use_ref_model=True)(
                theirs_hidden, whole, target, preference_labels=preference, ref_input=ref_hidden,
                ref_weight=ref_whole)[0]  # fmt: skip
        ours.backward()
        theirs.backward()
        assert ours_hidden.grad is not None and theirs_hidden.grad is not None and whole.grad is not None
        found[name] = {
            "loss": abs(float(ours.detach()) - float(theirs.detach())),
            "hidden_grad": float((ours_hidden.grad - theirs_hidden.grad).abs().max()),
            "head_grad": float((sharded.grad.full_tensor() - whole.grad).abs().max()),  # type: ignore[union-attr]
            "grad_norm": float(whole.grad.norm()),
        }
        assert found[name]["grad_norm"] > 0, (name, found[name])
        assert max(found[name]["loss"], found[name]["hidden_grad"], found[name]["head_grad"]) <= 1e-6, (name, found)
    return found


def _fused_loss(model: Any) -> torch.Tensor:
    """A fused loss on the vocabulary-sharded head (the model returns hidden states): each slice of the head
    gets its own gradient."""
    hidden = model(torch.zeros(1, 4, dtype=torch.long)).flatten(0, 1)
    return linear_cross_entropy(hidden, model.lm_head.weight, torch.arange(4))


def layout_and_warnings(tp: int, data_parallel: bool) -> dict[str, Any]:
    """What detect says of a model whose head is sharded over ``tp`` ranks (FSDP2 over the rest when
    ``data_parallel``), whether route_loss warns of unsynchronised replicas, and what check_grad_sync finds after
    the step (every rank the same batch: every copy equal)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from wrapperroute.check.wrap_fsdp import fsdp2_api

    model = build_model(TinyConfig())
    _, _, mesh = _head(tp)
    parallelize_module(model, mesh["tp"], {"lm_head": ColwiseParallel(use_local_output=False)})
    if data_parallel:
        fsdp2_api().fully_shard(model, mesh=mesh["dp"])
    found = detect(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        route_loss(model, model, _fused_loss, model).backward()
    report = check_grad_sync(model)
    layout = found.tensor_parallel
    return {
        "kind": found.kind,
        "dims": layout.dims if layout else None,
        "sharded": dict(layout.sharded) if layout else None,
        "head_vocab_sharded": layout.head_vocab_sharded if layout else None,
        "head_ranks": layout.head_ranks if layout else None,
        "warnings": [type(w.message).__name__ for w in caught],
        "sync": (report.compared, report.differing),
        "trainable": sum(1 for p in model.parameters() if p.requires_grad),
    }


def uneven_vocabulary(vocab: int) -> dict[str, Any]:
    """A vocabulary that does not divide by the 4 ranks (torch.chunk's split: 6 -> 2, 2, 2, 0): the rank holding
    no row still takes part, and every rank's loss and gradients equal torch's on the whole head."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    generator = torch.Generator().manual_seed(3)
    whole = torch.randn(vocab, HIDDEN, generator=generator, dtype=torch.float64)
    hidden = torch.randn(ROWS, HIDDEN, generator=generator, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, vocab, (ROWS,), generator=generator)
    weight = distribute_tensor(whole, mesh, [Shard(0)]).requires_grad_()
    whole.requires_grad_()
    ours = linear_cross_entropy(hidden, weight, target, chunk_size=5) + linear_logprobs(hidden, weight, target).sum()
    ours.backward()
    ours_hidden, hidden.grad = hidden.grad, None
    logits = hidden @ whole.t()
    picked = torch.log_softmax(logits, 1).gather(1, target[:, None]).sum()
    theirs = torch.nn.functional.cross_entropy(logits, target) + picked
    theirs.backward()
    assert ours_hidden is not None and hidden.grad is not None and whole.grad is not None
    assert torch.allclose(ours, theirs, atol=1e-12, rtol=0), (ours, theirs)
    assert torch.allclose(ours_hidden, hidden.grad, atol=1e-12, rtol=0)
    local = weight.grad.to_local()
    start = min(-(-vocab // dist.get_world_size()) * dist.get_rank(), vocab)
    assert torch.allclose(local, whole.grad[start : start + local.shape[0]], atol=1e-12, rtol=0)
    return {"rows": local.shape[0]}
