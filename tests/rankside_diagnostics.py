"""Rank bodies for tests/test_diagnostics.py: check_grad_sync and guard on real ranks."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
import torch.distributed as dist

from wrapperroute import GradSyncError, check_grad_sync, guard, route_loss
from wrapperroute.check.losses import LOSSES, make_batch
from wrapperroute.check.models import TinyConfig, build_model
from wrapperroute.check.wrappers import WRAPPERS

CONFIG = TinyConfig()
CASE = LOSSES["fused_ce"]


def sync_reports(wrapper: str) -> dict[str, Any]:
    """check_grad_sync after an unrouted and after a routed step."""
    wrapped = WRAPPERS[wrapper].build(build_model(CONFIG), {})
    batch = make_batch(CASE, CONFIG, dist.get_rank(), 0, 0)
    out: dict[str, Any] = {}
    if wrapper == "ddp":
        CASE.compute(wrapped.inner, batch, {}).backward()  # type: ignore[arg-type]
        report = check_grad_sync(wrapped.model)
        out["unrouted"] = {"differing": report.differing, "compared": report.compared, "table": report.table()}
        wrapped.inner.zero_grad(set_to_none=True)
    route_loss(wrapped.model, wrapped.inner, CASE.compute, wrapped.inner, batch, {}).backward()
    report = check_grad_sync(wrapped.model)
    out["routed"] = {"differing": report.differing, "compared": report.compared, "note": report.note}
    return out


def guard_verdicts() -> dict[str, Any]:
    """The guard raises on the unrouted DDP step and stays silent on normal, routed and no_sync steps."""
    wrapped = WRAPPERS["ddp"].build(build_model(CONFIG), {})
    model, inner = wrapped.model, wrapped.inner
    batch = make_batch(CASE, CONFIG, dist.get_rank(), 0, 0)
    verdicts: dict[str, Any] = {}

    def attempt(name: str, step: Any, ctx: Any = contextlib.nullcontext) -> None:
        try:
            with guard(model), ctx():
                step().backward()
            verdicts[name] = "ok"
        except GradSyncError as error:
            verdicts[name] = "caught: " + str(error)[:60]
        model.zero_grad(set_to_none=True)

    def normal() -> Any:  # the model called through the wrapper, loss from its output
        hidden = model(batch["input_ids"])
        return (hidden @ inner.lm_head.weight.t()).logsumexp(-1).mean()

    attempt("normal", normal)
    attempt("routed", lambda: route_loss(model, inner, CASE.compute, inner, batch, {}))
    attempt("no_sync_routed", lambda: route_loss(model, inner, CASE.compute, inner, batch, {}), model.no_sync)
    attempt("no_sync_unrouted", lambda: CASE.compute(inner, batch, {}), model.no_sync)
    attempt("unrouted", lambda: CASE.compute(inner, batch, {}))
    attempt("routed_after", lambda: route_loss(model, inner, CASE.compute, inner, batch, {}))
    for name, step in (("warn_unrouted", lambda: CASE.compute(inner, batch, {})),
                       ("warn_routed_after", lambda: route_loss(model, inner, CASE.compute, inner, batch, {}))):
        with warnings.catch_warnings(record=True) as caught, guard(model, on_error="warn"):
            warnings.simplefilter("always")
            step().backward()
        verdicts[name] = sum("without DDP's forward" in str(w.message) for w in caught)
        model.zero_grad(set_to_none=True)
    return verdicts


def adapter_after_fully_shard(sync: str) -> dict[str, Any]:
    """check_grad_sync after one step of tests/audit_scripts/adapters.py's model: a low-rank adapter added after
    ``fully_shard`` beside a frozen sharded base; ``sync``: "none", "hand" (gradients averaged by hand) or
    "shard" (the adapter sharded too). Returns the report's figures."""
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO / "tests" / "audit_scripts"))
    import adapters

    from wrapperroute._torch_internals import fsdp2_api

    fully_shard = fsdp2_api().fully_shard
    model = adapters.Adapted(build_model(CONFIG).requires_grad_(False))
    fully_shard(model)
    torch.manual_seed(0)
    model.down = torch.nn.Linear(CONFIG.hidden, 4, bias=False)
    model.up = torch.nn.Linear(4, CONFIG.hidden, bias=False)
    if sync == "shard":
        fully_shard(model.down)
        fully_shard(model.up)
    ids = make_batch(CASE, CONFIG, dist.get_rank(), 0, 0)["input_ids"]
    route_loss(model, model, adapters.fused_ce, model, ids).backward()
    if sync == "hand":
        for param in [*model.down.parameters(), *model.up.parameters()]:
            dist.all_reduce(param.grad)
    report = check_grad_sync(model)
    return {"differing": report.differing, "compared": report.compared, "note": report.note}
