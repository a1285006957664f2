"""``detect`` on real wrappers in one process (one gloo rank), and the autocast keeper (``_routing/kept.py``) on the
forward accelerate's mixed precision installs."""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from wrapperroute import RouteTypeError, detect
from wrapperroute._routing.kept import kept_forward_context
from wrapperroute.check.models import TinyConfig, build_model


def test_plain_module_and_compile_layer() -> None:
    model = build_model(TinyConfig())
    found = detect(model)
    assert (found.kind, found.chain, found.inner) == ("none", ("module",), model), f"a plain module: {found}"
    assert found.wrapper is None and found.entry is None, f"a plain module: {found.wrapper}, {found.entry}"
    compiled = detect(torch.compile(model))
    assert compiled.chain == ("compile", "module"), f"a compiled module's chain: {compiled.chain}"
    assert compiled.inner is model and not compiled.distributed, f"a compiled module: {compiled}"


def test_the_layout_is_read_when_asked_not_per_call() -> None:
    """``detect`` runs every step under ``@routed`` and ``patch_trl``: it reads no parameter; the tensor-parallel
    layout walks them on first access, once."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    calls = []
    walk = model.named_parameters
    model.named_parameters = lambda *a, **k: calls.append(1) or walk(*a, **k)  # type: ignore[method-assign]
    found = detect(model)
    assert calls == [], f"detect read the parameters {len(calls)} times"
    assert repr(found) == "Detection(kind='none', chain=('module',), details={})", repr(found)
    assert found.tensor_parallel is None and found.tensor_parallel is None, f"{found.tensor_parallel}"
    assert calls == [1], f"the layout read the parameters {len(calls)} times over two accesses, not once"


def test_not_a_module_is_named() -> None:
    with pytest.raises(RouteTypeError, match="got type"):
        detect(nn.Linear)  # type: ignore[arg-type]


def test_wrappers_on_one_rank(one_rank: None) -> None:
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.fsdp import fully_shard

    inner = build_model(TinyConfig())
    ddp = detect(torch.compile(DDP(inner)))
    assert (ddp.kind, ddp.chain, ddp.inner) == ("ddp", ("compile", "ddp", "module"), inner), f"compile(DDP): {ddp}"
    assert ddp.entry is ddp.wrapper, f"compile(DDP) entered at {type(ddp.entry).__name__}, not DDP"
    assert ddp.details["find_unused_parameters"] is False, f"compile(DDP)'s details: {ddp.details}"
    composable = replicate(build_model(TinyConfig()), find_unused_parameters=True)
    found = detect(composable)
    assert (found.kind, found.chain, found.wrapper) == ("replicate", ("replicate", "module"), composable), found
    # read before the lazy DDP exists
    assert found.details["find_unused_parameters"] is True, f"replicate's details: {found.details}"
    sharded = build_model(TinyConfig())
    fully_shard(sharded.lm_head)
    fully_shard(sharded)
    fsdp2 = detect(sharded)
    assert (fsdp2.kind, fsdp2.chain, fsdp2.details["nested_groups"]) == ("fsdp2", ("fsdp2", "module"), 1), fsdp2


def test_read_whole_on_one_rank(one_rank: None) -> None:
    """A frozen model read outside its forward: replicated wrappers hold its weights whole already (nothing
    entered); FSDP2 holds the root's group whole; FSDP1 says that it does not, instead of passing over it."""
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    from wrapperroute.adapters import ReadWhole

    ddp = detect(DDP(build_model(TinyConfig())))
    assert not isinstance(ddp.adapter, ReadWhole), "DDP holds every weight whole: nothing to enter"
    sharded = build_model(TinyConfig())
    fully_shard(sharded)
    fsdp2 = detect(sharded)
    assert isinstance(fsdp2.adapter, ReadWhole), fsdp2
    with fsdp2.adapter.read_whole(sharded):
        # unsharded: the plain parameter, not a DTensor
        assert type(sharded.embed.weight) is nn.Parameter, f"inside read_whole: a {type(sharded.embed.weight)}"
        shape = sharded.embed(torch.zeros(1, 2, dtype=torch.long)).shape
        assert shape == (1, 2, TinyConfig().hidden), f"inside read_whole the embedding gives {tuple(shape)}"
    # resharded on the way out
    assert type(sharded.embed.weight).__name__ == "DTensor", f"after read_whole: a {type(sharded.embed.weight)}"
    fsdp1 = detect(FullyShardedDataParallel(build_model(TinyConfig()), device_id=torch.device("cpu")))
    assert isinstance(fsdp1.adapter, ReadWhole) and fsdp1.wrapper is not None, fsdp1
    with pytest.warns(RuntimeWarning, match="frozen FSDP1 model"), fsdp1.adapter.read_whole(fsdp1.wrapper):
        pass


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="lightning is not installed")
def test_fabric_on_one_device_is_entered_not_distributed() -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    model = build_model(TinyConfig())
    module = fabric.setup_module(model)
    found = detect(module)
    assert (found.kind, found.chain, found.inner) == ("none", ("fabric", "module"), model), f"Fabric, 1 device: {found}"
    assert found.entry is module and not found.distributed, f"Fabric, 1 device: {found.entry}, {found.distributed}"


def test_autocast_kept_from_an_instance_forward() -> None:
    """accelerate's mixed precision wraps the instance forward in autocast (and an fp32 output conversion):
    the keeper finds the autocast and re-enters one with the same settings; a class forward keeps nothing."""
    model = nn.Linear(4, 4)
    assert kept_forward_context(model, model.forward) is None, "a context kept from no instance forward"
    wrapped = torch.autocast("cpu", dtype=torch.bfloat16)(type(model).forward)
    model.forward = types.MethodType(wrapped, model)
    context = kept_forward_context(model, model.forward)
    assert context is not None, "no context kept from an autocast instance forward"
    with context():
        enabled, dtype = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
        assert enabled and dtype == torch.bfloat16, f"the kept context: autocast {enabled}, {dtype}"
    assert not torch.is_autocast_enabled("cpu"), "autocast still on after the kept context"
    plain = nn.Linear(4, 4)
    plain.forward = types.MethodType(type(plain).forward, plain)  # an instance forward with nothing around it
    assert kept_forward_context(plain, plain.forward) is None, "a context kept from a forward with nothing around it"


def test_expert_and_context_dimensions_are_not_tensor_parallel() -> None:
    """Mesh dimensions named as torchtitan and transformers name expert and context parallelism: their ranks hold
    other experts or other parts of a sequence, not slices of one layer."""
    from wrapperroute._tensor_parallel import _other_parallelism

    other = ("ep", "cp", "dp_shard_mod_ep", "dp_shard_in_ep", "experts")
    missed = [name for name in other if not _other_parallelism(name)]
    assert not missed, f"taken for tensor parallelism: {missed}"
    taken = [name for name in ("tp", "dp", "dp_shard", "dp_replicate", "etp", "fsdp") if _other_parallelism(name)]
    assert not taken, f"taken for expert or context parallelism: {taken}"
