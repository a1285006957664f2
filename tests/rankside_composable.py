"""Rank bodies for tests/test_composable.py (module level: the pool pickles them by reference). Each asserts its
facts where it finds them."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from wrapperroute import UnroutedModelWarning, check_grad_sync, detect, guard, route_loss
from wrapperroute.check.cell import REFERENCE_TOLERANCE, differing_across_ranks, max_grad_diff
from wrapperroute.check.losses import LOSSES, make_batch
from wrapperroute.check.models import TinyConfig, build_model
from wrapperroute.check.wrappers import WRAPPERS

CONFIG = TinyConfig()


def _reference_grads(step: int = 0) -> dict[str, torch.Tensor]:
    """One process, the concatenated global batch, the same initial weights."""
    case = LOSSES["fused_ce"]
    model = build_model(CONFIG)
    batches = [make_batch(case, CONFIG, r, step, 0) for r in range(dist.get_world_size())]
    case.compute(model, case.concat(batches), {}).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _lightning_module(holder: str, seen: dict[str, Any]) -> Any:
    """A LightningModule whose ``training_step`` routes a fused loss (reads ``lm_head.weight``), passing
    ``holder`` as the model: ``"strategy_model"`` (the DDP the strategy holds) or ``"self"``. Into ``seen``:
    per loss call whether it ran directly (not entered a second time), the wrapper detected inside the step, what
    route_loss warned there, and what it warned from a hook outside the forward. It keeps the gradients the
    optimizer step sees (``grads``)."""
    import lightning as L

    case = LOSSES["fused_ce"]

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model(CONFIG)
            self.grads: dict[str, torch.Tensor] = {}

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            inner = self.model

            def loss_fn() -> torch.Tensor:
                seen["direct"].append(not _in_dispatch())  # called as it is, not entered a second time
                seen["kind"] = detect(self.trainer.strategy.model).kind
                return case.compute(inner, batch, {})

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model = self.trainer.strategy.model if holder == "strategy_model" else self
                loss = route_loss(model, self, loss_fn)
            seen["warnings"] += [str(w.message) for w in caught if issubclass(w.category, UnroutedModelWarning)]
            return loss

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            # Outside the strategy's forward, the same call has no wrapper around it: said loudly.
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                route_loss(self, self, lambda: None)
            seen["outside"] = [str(w.message) for w in caught if issubclass(w.category, UnroutedModelWarning)]

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.grads = {
                n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                for n, p in self.model.named_parameters()
            }

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return Module()


def lightning_trainer_step(holder: str) -> None:
    """A real ``L.Trainer(accelerator="cpu", devices=2, strategy="ddp")`` step of ``_lightning_module(holder)``:
    training_step already runs inside the strategy's DDP forward, so the loss is called directly, exact, and
    quiet; the same call from a hook outside the forward warns."""
    import lightning as L

    rank, world = dist.get_rank(), dist.get_world_size()
    seen: dict[str, Any] = {"direct": [], "warnings": []}
    module = _lightning_module(holder, seen)
    data = torch.utils.data.DataLoader([make_batch(LOSSES["fused_ce"], CONFIG, rank, 0, 0)], batch_size=None)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # each rank its own batch, rebuilt for the reference
    )
    trainer.fit(module, data)
    grads = module.grads
    differ, _ = differing_across_ranks(grads)
    ref_diff = max_grad_diff(grads, _reference_grads())
    assert seen["kind"] == "ddp", f"inside training_step the strategy's model is detected as {seen['kind']}"
    assert seen["direct"] == [True], f"the loss called directly (not entered a second time), per call: {seen['direct']}"
    assert grads and differ == 0, f"{differ} of {len(grads)} parameters' gradients differ across ranks"
    assert ref_diff <= REFERENCE_TOLERANCE, f"gradients {ref_diff:.3g} from one process's on the global batch"
    assert seen["warnings"] == [], f"route_loss warned inside the strategy's forward: {seen['warnings']}"
    outside = seen["outside"]
    assert len(outside) == 1 and "no distributed wrapper" in outside[0], f"outside the forward it said {outside}"


def _in_dispatch() -> bool:
    """Whether this call runs inside wrapperroute's swapped forward (the loss entered through a wrapper)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "forward" and code.co_filename.endswith(os.path.join("wrapperroute", "_routing", "swap.py")):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def fabric_autocast(routed: bool) -> None:
    """Fabric ``precision="bf16-mixed"`` over DDP. Routed: the loss runs under Fabric's autocast (bf16 logits)
    and the ranks' gradients agree; computed on the module directly (``routed=False``, the premise), it runs in
    fp32 outside autocast and the ranks diverge."""
    wrapped = WRAPPERS["fabric_ddp"].build(build_model(CONFIG), {"precision": "bf16-mixed"})
    inner: Any = wrapped.inner
    batch = make_batch(LOSSES["fused_ce"], CONFIG, dist.get_rank(), 0, 0)
    seen: dict[str, Any] = {}

    def loss_fn() -> torch.Tensor:
        # fused_cross_entropy's maths, written out: the body records the logits' dtype on the way
        hidden = inner(batch["input_ids"])
        logits = hidden @ inner.lm_head.weight.t()
        seen["autocast"] = torch.is_autocast_enabled("cpu")
        seen["logits"] = str(logits.dtype)
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())

    loss = route_loss(wrapped.model, inner, loss_fn) if routed else loss_fn()
    wrapped.backward(loss)
    differ, _ = differing_across_ranks(wrapped.full_grads())
    kind = detect(wrapped.model).kind
    assert kind == "ddp", f"Fabric's module detected as {kind}"
    if routed:
        assert seen["autocast"] and seen["logits"] == "torch.bfloat16", f"routed, the loss saw {seen}: no autocast"
        assert differ == 0, f"routed: {differ} parameters' gradients differ across ranks"
    else:
        assert not seen["autocast"] and seen["logits"] == "torch.float32", f"unrouted, the loss saw {seen}"
        assert differ > 0, "unrouted, the ranks' gradients agree: the premise (a desync) does not hold"


def sync_tools(wrapper: str, routed: bool) -> None:
    """check_grad_sync and guard on a composable wrapper, after a step that reads the backbone directly:
    unrouted, guard raises and check_grad_sync counts the desync; routed, both agree the ranks are in sync."""
    wrapped = WRAPPERS[wrapper].build(build_model(CONFIG), {})
    case = LOSSES["backbone_ce"]
    batch = make_batch(case, CONFIG, dist.get_rank(), 0, 0)
    guarded = None
    try:
        with guard(wrapped.model):
            loss = (
                route_loss(wrapped.model, wrapped.inner, case.compute, wrapped.inner, batch, {})
                if routed
                else case.compute(wrapped.inner, batch, {})  # type: ignore[arg-type]
            )
            loss.backward()
    except Exception as error:
        guarded = type(error).__name__
    if guarded is not None:  # guard raised inside the backward: the gradients are partial; run it unguarded
        wrapped.step()
        case.compute(wrapped.inner, batch, {}).backward()  # type: ignore[arg-type]
    report = check_grad_sync(wrapped.model)
    said = f"guard raised {guarded}; check_grad_sync: {report.differing} of {report.compared} differ"
    if routed:
        assert guarded is None and report.in_sync and report.compared > 0, f"{wrapper}, routed: {said}"
    else:
        caught = guarded == "GradSyncError" and not report.in_sync and report.differing > 0
        assert caught, f"{wrapper}, unrouted: {said}"


class HandRolled(nn.Module):
    """A wrapper no adapter knows: it synchronises nothing."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any) -> Any:
        return self.module(*args)


def _said(model: nn.Module, calls: int = 2) -> list[str]:
    """What route_loss says (UnroutedModelWarning) over ``calls`` calls on a model with no distributed wrapper."""
    ids = make_batch(LOSSES["fused_ce"], CONFIG, dist.get_rank(), 0, 0)["input_ids"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(calls):
            route_loss(model, None, lambda: model(ids).sum())
    return [str(w.message) for w in caught if issubclass(w.category, UnroutedModelWarning)]


def warns_once_for_a_hand_rolled_wrapper() -> None:
    """A wrapper no adapter knows, on 2 ranks: said once per model (two calls each, and another model of the
    same class is said again), naming the class, the ranks, and the warning (how to silence it)."""
    for which in ("first", "second"):
        said = _said(HandRolled(build_model(CONFIG)))
        assert len(said) == 1, f"the {which} HandRolled model, two calls: said {said}"
        assert "HandRolled" in said[0] and "2 ranks" in said[0], f"the {which} model's warning: {said[0]}"
        assert "UnroutedModelWarning" in said[0], f"the warning does not say how to silence it: {said[0]}"


def quiet_for_a_frozen_module() -> None:
    said = _said(build_model(CONFIG).requires_grad_(False))
    assert said == [], f"a frozen module (nothing to synchronise): said {said}"


def quiet_under_no_grad_until_a_call_with_grad() -> None:
    """A trainable model called without grad first (a teacher) is judged at each call: quiet, then said."""
    teacher = HandRolled(build_model(CONFIG))
    with torch.no_grad():
        said = _said(teacher)
    assert said == [], f"under no_grad: said {said}"
    said = _said(teacher)
    assert len(said) == 1 and "HandRolled" in said[0], f"with grad after no_grad calls: said {said}"


def unknown_composable_state_is_an_error() -> None:
    """An API of torch's composable kind no adapter knows, on a submodule: a RouteValueError naming it, and no
    forward left on the model."""
    from torch.distributed._composable.contract import contract

    @contract()
    def shard_somehow(module: nn.Module) -> nn.Module:
        return module

    ids = make_batch(LOSSES["fused_ce"], CONFIG, dist.get_rank(), 0, 0)["input_ids"]
    model = build_model(CONFIG)
    shard_somehow(model.get_submodule("lm_head"))
    raised = None
    try:
        route_loss(model, None, lambda: model(ids).sum())
    except Exception as error:
        raised = f"{type(error).__name__}: {error}"
    assert raised is not None and raised.startswith("RouteValueError"), f"an unknown composable state: {raised}"
    assert "lm_head (Linear): shard_somehow" in raised, f"the error does not name the module and the API: {raised}"
    assert "forward" not in model.__dict__, "the failed call left an instance forward"


def detected(expected: dict[str, tuple[str, tuple[str, ...]]]) -> None:
    """Each wrapper named in ``expected`` detected as its (kind, chain)."""
    for name, (kind, chain) in expected.items():
        found = detect(WRAPPERS[name].build(build_model(CONFIG), {}).model)
        assert (found.kind, found.chain) == (kind, chain), f"{name}: detected {found.kind}, {found.chain}"
