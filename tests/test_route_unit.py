"""Single-process checks: detection, the no-wrapper path, argument errors, and the token's journey through
the input handling DDP applies (the multi-rank behaviour is in test_route_ddp.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import wrapperroute as wr
from wrapperroute._routing.run import _is_graph_optimizer_failure, fallback_key
from wrapperroute._routing.swap import Call, swap_for
from wrapperroute.check.models import TinyConfig, build_model


def test_detect_plain_and_compiled() -> None:
    model = build_model(TinyConfig())
    found = wr.detect(model)
    assert (found.kind, found.chain, found.inner, found.wrapper) == ("none", ("module",), model, None), found
    compiled = torch.compile(model)
    found = wr.detect(compiled)
    assert found.kind == "none" and found.chain == ("compile", "module"), f"a compiled module: {found}"
    assert found.inner is model, f"a compiled module's inner is a {type(found.inner).__name__}, not the model"
    with pytest.raises(AttributeError):
        found.kind = "ddp"  # type: ignore[misc]  # immutable


def test_no_wrapper_calls_fn_directly() -> None:
    model = build_model(TinyConfig())
    ids = torch.zeros(1, 4, dtype=torch.long)
    out = wr.route_loss(model, model, lambda x, scale=1.0: model(x).sum() * scale, ids, scale=2.0)
    expected = model(ids).sum() * 2.0
    assert torch.allclose(out, expected), f"fn(ids, scale=2.0) gave {float(out)}, called directly {float(expected)}"
    assert "forward" not in model.__dict__, "the call left an instance forward"


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda m: wr.route_loss(m, m, 3), wr.RouteTypeError, "fn must be callable"),
        (lambda m: wr.route_loss("model", None, lambda: 0), wr.RouteTypeError, "model must be a torch.nn.Module"),
        (lambda m: wr.route_loss(m, "inner", lambda: 0), wr.RouteTypeError, "unwrapped must be an nn.Module"),
        (lambda m: wr.route_loss(m, nn.Linear(2, 2), lambda: 0), wr.RouteValueError, "is not inside model"),
        (lambda m: wr.route_loss(m, m, lambda: 0, mode="fast"), wr.RouteValueError, "mode must be one of"),
        (lambda m: wr.route_loss(m, m, lambda: 0, gather=[3]), wr.RouteTypeError, "gather= takes nn.Module"),
        (lambda m: wr.route_loss(m, m, lambda: 0, gather=nn.Linear(1, 1)), wr.RouteValueError, "not inside"),
    ],
    ids=["fn", "model", "unwrapped-type", "unwrapped-outside", "mode", "gather-type", "gather-outside"],
)
def test_bad_input_is_named(call, error, words) -> None:  # type: ignore[no-untyped-def]
    model = build_model(TinyConfig())
    with pytest.raises(error, match=words) as info:
        call(model)
    assert isinstance(info.value, wr.WrapperRouteError), f"{info.value!r} is not a WrapperRouteError"
    assert "forward" not in model.__dict__, "the failed call left an instance forward"


def test_submodule_is_accepted_as_unwrapped() -> None:
    model = build_model(TinyConfig())
    value = wr.route_loss(model, model.lm_head, lambda: 5)
    assert value == 5, f"fn's 5 came back as {value!r}"


def test_call_survives_ddp_input_handling() -> None:
    """DDP moves (``_to_kwargs``) and casts (``_cast_forward_inputs``) its inputs: the call, a plain object
    that is neither tensor nor container, must come out as the very same object. This is what makes a call
    with ``device_ids`` set work (no GPU here to run DDP with device_ids)."""
    from torch.distributed.utils import _cast_forward_inputs, _to_kwargs

    from wrapperroute.adapters.ddp import DDPAdapter

    module = nn.Linear(1, 1)
    call = Call(module, module, module, swap_for(module), DDPAdapter(), print, (), {}, None, None, "auto")
    moved_args, moved_kwargs = _to_kwargs((call,), {}, torch.device("cpu"), False)
    assert moved_args[0][0] is call, f"DDP's move gave back {moved_args[0][0]!r}, not the call itself"
    assert moved_kwargs[0] == {}, f"DDP's move made keyword arguments: {moved_kwargs[0]}"
    cast_args, _ = _cast_forward_inputs(torch.bfloat16, call)
    assert cast_args[0] is call, f"DDP's cast gave back {cast_args[0]!r}, not the call itself"


def test_fallback_key_is_stable_across_closures() -> None:
    def make() -> object:
        return lambda: 1

    first, second = fallback_key(make()), fallback_key(make())
    assert first == second, f"two closures of one lambda keyed apart: {first!r}, {second!r}"
    import functools

    partial, plain = fallback_key(functools.partial(make)), fallback_key(make)
    assert partial == plain, f"a partial keyed apart from its function: {partial!r}, {plain!r}"


def test_graph_optimizer_failure_is_recognised_through_the_chain() -> None:
    inner = NotImplementedError("Cannot access storage of TensorWrapper")
    outer = RuntimeError("backend compiler failed")
    outer.__cause__ = inner
    assert _is_graph_optimizer_failure(outer), "the TensorWrapper failure as a compile error's cause is not recognised"
    assert not _is_graph_optimizer_failure(RuntimeError("shape mismatch")), "a shape mismatch taken for one"


def test_each_wrapper_family_has_the_capabilities_its_wrapper_needs() -> None:
    """What each built-in adapter is, by the protocols it has: the table docs/mechanism.md gives. A capability
    dropped by mistake would skip its verbs silently (the functorch fallback under replicate, the hooks set aside
    under FSDP2), so the table is pinned here; that each one's verbs exist, the abstract classes and mypy see to."""
    import importlib
    import importlib.util

    from wrapperroute.adapters import (
        ArmsInForward,
        AroundLoss,
        Isolating,
        ReadWhole,
        Routing,
        ShardUnits,
        Topology,
        registered,
    )

    for package in ("deepspeed", "peft", "lightning"):  # their adapters are made once the package is imported
        if importlib.util.find_spec(package) is not None:
            importlib.import_module(package)
    expected = {
        "compile": set(),
        "peft": set(),
        "fabric": {Routing},
        "ddp": {Routing, Topology, Isolating, ArmsInForward},
        "replicate": {Routing, Topology, AroundLoss, Isolating, ArmsInForward},
        "fsdp1": {Routing, Topology, ShardUnits, ReadWhole},
        "fsdp2": {Routing, Topology, AroundLoss, ShardUnits, ReadWhole},
        "replicate_fsdp": {Routing, Topology, AroundLoss, ShardUnits, ReadWhole},
        "deepspeed": {Routing, Topology, AroundLoss, ReadWhole},
    }
    protocols = (Routing, Topology, AroundLoss, Isolating, ShardUnits, ArmsInForward, ReadWhole)
    found = {adapter.kind: {p for p in protocols if isinstance(adapter, p)} for adapter in registered()}
    for kind, has in found.items():
        if kind in expected:
            assert has == expected[kind], f"{kind}: has {sorted(p.__name__ for p in has)}"
    assert {"compile", "ddp", "replicate", "fsdp1", "fsdp2", "replicate_fsdp"} <= set(found), sorted(found)
