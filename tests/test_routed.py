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
    assert decorated.__name__ == "fused_loss"
    assert decorated.__doc__ == "A loss docstring."
    assert inspect.signature(decorated) == inspect.signature(fused_loss)
    assert Trainer.routed_compute_loss.__name__ == "routed_compute_loss"
    assert inspect.signature(Trainer.routed_compute_loss) == inspect.signature(Trainer.compute_loss)
    assert inspect.signature(Trainer().routed_compute_loss) == inspect.signature(Trainer().compute_loss)
    assert routed(mode="isolate")(fused_loss).__qualname__ == fused_loss.__qualname__


def test_single_process_is_a_noop() -> None:
    model = nn.Linear(3, 1)
    x = torch.randn(2, 3)
    trainer = Trainer()
    expected = model(x).sum()
    assert torch.equal(routed(fused_loss)(model, {"x": x}), expected)
    assert torch.equal(routed(fused_loss)(inputs={"x": x}, model=model, scale=1.0), expected)
    assert torch.equal(trainer.routed_compute_loss(model, {"x": x}), expected)  # bound
    assert torch.equal(Trainer.routed_compute_loss(trainer, model, {"x": x}), expected)  # unbound
    assert torch.equal(routed(trainer.compute_loss)(model, {"x": x}), expected)  # a bound method decorated
    assert torch.equal(Trainer.static_loss(model, x), expected)
    assert torch.equal(trainer.class_loss(model, x), expected)
    _loss, seen = trainer.routed_compute_loss(model, {"x": x}, return_outputs=True)
    assert seen is model  # no wrapper: the body gets exactly what it was given
    compiled = torch.compile(model)
    assert routed(lambda model: model)(compiled) is compiled  # a compile-only layer is not distributed


def test_model_argument_resolution() -> None:
    model = nn.Linear(2, 1)

    @routed(model_arg="student")
    def distill(teacher: Any, student: nn.Module) -> nn.Module:
        return student

    @routed
    def first(net: nn.Module, x: int) -> nn.Module:
        return net

    assert distill(None, model) is model
    assert first(model, 1) is model
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
    results = pool.run(rankside_routed.routed_functions_ddp)
    for rank in results:
        assert rank["seen"] == "TinyCausalLM"  # the body sees the unwrapped model, not DDP
        undecorated = rank.pop("undecorated")
        assert undecorated["differ"] == undecorated["params"] > 0, "the undecorated loss must show the bug"
        for name, cell in rank.items():
            if name != "seen":
                assert cell["differ"] == 0 and cell["max_diff"] == 0.0, (name, cell)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_hf_trainer_subclass_under_ddp(pool: RankPool) -> None:
    plain = pool.run(rankside_routed.hf_trainer_routed, False)[0]
    decorated = pool.run(rankside_routed.hf_trainer_routed, True)[0]
    print(f"\nHF Trainer fused compute_loss: undecorated {plain}, @routed {decorated}")
    assert plain["wrapper"] == decorated["wrapper"] == "DistributedDataParallel"
    assert plain["differ"] == plain["params"] > 0
    assert decorated["differ"] == 0 and decorated["max_diff"] == 0.0
