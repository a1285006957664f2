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


def test_fast_path_facts_match_what_the_adapters_do() -> None:
    """route_loss and the audit trust each adapter's class facts instead of asking: one that says it picks no
    units must not override the two methods its fast path skips; one that marks no forward must not override
    in_forward or repair; one that isolates must have an around_loss of its own to isolate with; one whose gradient
    sync is armed in its forward says when it syncs; one that says it does not shard names its replicas. A layer
    that is only peeled has no routing verb at all."""
    import importlib
    import importlib.util

    from wrapperroute.adapters import registered
    from wrapperroute.adapters.base import NOTHING, Adapter

    for package in ("deepspeed", "peft", "lightning"):  # their adapters register once the package is imported
        if importlib.util.find_spec(package) is not None:
            importlib.import_module(package)
    for adapter in registered():
        kind = type(adapter)
        if not isinstance(adapter, Adapter):
            assert not adapter.distributed and not hasattr(adapter, "around_loss"), kind
            continue
        if kind.marks_forward is Adapter.marks_forward:  # marks nothing: route_loss never asks the other two
            assert kind.repair is Adapter.repair and kind.in_forward is Adapter.in_forward, kind
        if adapter.isolates:
            assert kind.around_loss is not Adapter.around_loss, kind
        if adapter.arms_in_forward:
            assert kind.syncs_gradients is not Adapter.syncs_gradients, kind
        if adapter.distributed and not adapter.shards:
            assert kind.replicas is not Adapter.replicas, kind  # the default says every parameter is sharded
        if kind.around_loss is Adapter.around_loss:  # the plan asks once; the base answers NOTHING
            assert adapter.around_loss(torch.nn.Linear(1, 1), isolate=False, gather=()) is NOTHING, kind
        if not adapter.picks_units:
            assert kind.validate_gather is Adapter.validate_gather, kind
            assert kind.nested_units is Adapter.nested_units, kind
