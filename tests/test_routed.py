"""``@routed``: a no-op in one process that keeps the function's identity, and exact gradients under
DDP, on plain functions, methods and a real HF ``Trainer`` subclass, next to the same code undecorated."""

from __future__ import annotations

import importlib.util
import inspect
from typing import Any

import pytest
import rankside_routed
import torch
from torch import nn

from wrapperroute.decorators import routed
from wrapperroute.errors import RouteTypeError, RouteValueError
from wrapperroute.ranks import RankPool


def fused_loss(model: nn.Module, inputs: dict[str, torch.Tensor], scale: float = 1.0) -> torch.Tensor:
    """A loss docstring."""
    return model(inputs["x"]).sum() * scale


class Trainer:
    def compute_loss(
        self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """HF signature."""
        loss = model(inputs["x"]).sum()
        return (loss, model) if return_outputs else loss

    @routed
    def routed_compute_loss(
        self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """HF signature, routed."""
        loss = model(inputs["x"]).sum()
        return (loss, model) if return_outputs else loss

    @routed
    @staticmethod
    def static_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).sum()

    @routed
    @classmethod
    def class_loss(cls, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).sum()


def test_keeps_name_docstring_and_signature() -> None:
    decorated = routed(fused_loss)
    assert decorated.__name__ == "fused_loss", f"the decorated function is named {decorated.__name__}"
    assert decorated.__doc__ == "A loss docstring.", f"the decorated docstring: {decorated.__doc__!r}"
    signature = inspect.signature(decorated)
    assert signature == inspect.signature(fused_loss), f"the decorated signature: {signature}"
    name = Trainer.routed_compute_loss.__name__
    assert name == "routed_compute_loss", f"the decorated method is named {name}"
    signature = inspect.signature(Trainer.routed_compute_loss)
    assert signature == inspect.signature(Trainer.compute_loss), f"the decorated method's signature: {signature}"
    signature = inspect.signature(Trainer().routed_compute_loss)
    assert signature == inspect.signature(Trainer().compute_loss), f"the bound decorated method's: {signature}"
    qualname = routed(mode="isolate")(fused_loss).__qualname__
    assert qualname == fused_loss.__qualname__, f"decorated with arguments, the qualified name is {qualname}"


def test_single_process_is_a_noop() -> None:
    model = nn.Linear(3, 1)
    x = torch.randn(2, 3)
    trainer = Trainer()
    expected = model(x).sum()
    calls = {
        "function": lambda: routed(fused_loss)(model, {"x": x}),
        "function, keywords": lambda: routed(fused_loss)(inputs={"x": x}, model=model, scale=1.0),
        "bound method": lambda: trainer.routed_compute_loss(model, {"x": x}),
        "unbound method": lambda: Trainer.routed_compute_loss(trainer, model, {"x": x}),
        "a bound method decorated": lambda: routed(trainer.compute_loss)(model, {"x": x}),
        "staticmethod": lambda: Trainer.static_loss(model, x),
        "classmethod": lambda: trainer.class_loss(model, x),
    }
    for way, call in calls.items():
        got = call()
        assert torch.equal(got, expected), f"{way}: {float(got)}, called undecorated {float(expected)}"
    _loss, seen = trainer.routed_compute_loss(model, {"x": x}, return_outputs=True)
    # no wrapper: the body gets exactly what it was given
    assert seen is model, f"the body got a {type(seen).__name__}, not the model it was given"
    compiled = torch.compile(model)
    # a compile-only layer is not distributed
    assert routed(lambda model: model)(compiled) is compiled, "the body did not get the compiled model as given"


def test_model_argument_resolution() -> None:
    model = nn.Linear(2, 1)

    @routed(model_arg="student")
    def distill(teacher: Any, student: nn.Module) -> nn.Module:
        return student

    @routed
    def first(net: nn.Module, x: int) -> nn.Module:
        return net

    assert distill(None, model) is model, "model_arg='student' did not pass the student through"
    assert first(model, 1) is model, "the first parameter did not pass the model through"
    with pytest.raises(RouteValueError, match="no such parameter"):
        routed(model_arg="nope")(fused_loss)
    with pytest.raises(RouteValueError, match="cannot tell"):
        routed(lambda *args: None)
    with pytest.raises(RouteValueError, match="mode"):
        routed(mode="bogus")  # type: ignore[call-overload]
    with pytest.raises(RouteTypeError):
        routed(42)  # type: ignore[call-overload]
    with pytest.raises(TypeError):  # the function's own TypeError for a bad call
        routed(fused_loss)(model)  # type: ignore[call-arg]


def test_routed_functions_and_methods_under_ddp(pool: RankPool) -> None:
    pool.run(rankside_routed.routed_functions_ddp)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_hf_trainer_subclass_under_ddp(pool: RankPool) -> None:
    pool.run(rankside_routed.hf_trainer_routed, False)
    pool.run(rankside_routed.hf_trainer_routed, True)
