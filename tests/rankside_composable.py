"""Rank bodies for tests/test_composable.py (module level: the pool pickles them by reference)."""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from wrapperroute import UnroutedModelWarning, check_grad_sync, detect, guard, route_loss
from wrapperroute.check.cell import differing_across_ranks, max_grad_diff
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


def lightning_trainer_step(holder: str) -> dict[str, Any]:
    """A real ``L.Trainer(accelerator="cpu", devices=2, strategy="ddp")`` step whose ``training_step`` computes
    a fused loss (reads ``lm_head.weight``) through ``route_loss``. ``holder``: what is passed as the model:
    ``"strategy_model"`` (the DDP the strategy holds) or ``"self"`` (the LightningModule)."""
    import lightning as L

    rank, world = dist.get_rank(), dist.get_world_size()
    case = LOSSES["fused_ce"]
    seen: dict[str, Any] = {"direct": [], "warnings": []}

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

    module = Module()
    data = torch.utils.data.DataLoader([make_batch(case, CONFIG, rank, 0, 0)], batch_size=None)
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
    return {
        "differ": differ,
        "params": len(grads),
        "max_ref_diff": max_grad_diff(grads, _reference_grads()),
        "direct": seen["direct"],
        "warnings": seen["warnings"],
        "kind": seen["kind"],
        "outside": seen["outside"],
    }


def _in_dispatch() -> bool:
    """Whether this call runs inside wrapperroute's swapped forward (the loss entered through a wrapper)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "forward" and code.co_filename.endswith(os.path.join("wrapperroute", "_routing", "swap.py")):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def fabric_autocast(routed: bool) -> dict[str, Any]:
    """Fabric ``precision="bf16-mixed"`` over DDP: what the loss sees (autocast, logits dtype) and whether the
    ranks' gradients agree."""
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
    differ, worst = differing_across_ranks(wrapped.full_grads())
    return {**seen, "differ": differ, "max_rank_diff": worst, "kind": detect(wrapped.model).kind}


def sync_tools(wrapper: str, routed: bool) -> dict[str, Any]:
    """check_grad_sync and guard on a composable wrapper, after a step that reads the backbone directly."""
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
    return {"guard": guarded, "in_sync": report.in_sync, "differing": report.differing, "compared": report.compared}


class HandRolled(nn.Module):
    """A wrapper no adapter knows: it synchronises nothing."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any) -> Any:
        return self.module(*args)


def unrouted_warnings() -> dict[str, Any]:
    """What route_loss says about models with no distributed wrapper, on 2 ranks."""
    ids = make_batch(LOSSES["fused_ce"], CONFIG, dist.get_rank(), 0, 0)["input_ids"]
    out: dict[str, Any] = {}

    def said(model: nn.Module, calls: int = 2) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(calls):
                route_loss(model, None, lambda: model(ids).sum())
        return [str(w.message) for w in caught if issubclass(w.category, UnroutedModelWarning)]

    out["hand_rolled"] = said(HandRolled(build_model(CONFIG)))
    out["second_hand_rolled"] = said(HandRolled(build_model(CONFIG)))  # another model of the same class
    out["frozen"] = said(build_model(CONFIG).requires_grad_(False))
    teacher = HandRolled(build_model(CONFIG))  # trainable, but called without grad first: judged at each call
    with torch.no_grad():
        out["no_grad"] = said(teacher)
    out["no_grad_then_grad"] = said(teacher)
    from torch.distributed._composable.contract import contract

    @contract()
    def shard_somehow(module: nn.Module) -> nn.Module:  # an API of torch's composable kind no adapter knows
        return module

    model = build_model(CONFIG)
    shard_somehow(model.get_submodule("lm_head"))
    try:
        route_loss(model, None, lambda: model(ids).sum())
        out["composable"] = None
    except Exception as error:
        out["composable"] = f"{type(error).__name__}: {error}"
    out["left"] = "forward" in model.__dict__
    return out


def detected() -> dict[str, Any]:
    out: dict[str, Any] = {}
    names = ["replicate", "replicate_fsdp"]
    if importlib.util.find_spec("lightning") is not None:
        names.append("fabric_ddp")
    for name in names:
        found = detect(WRAPPERS[name].build(build_model(CONFIG), {}).model)
        out[name] = (found.kind, found.chain)
    return out
