"""Rank bodies for tests/test_diagnostics.py: check_grad_sync and guard on real ranks, each asserting what they
report where it is reported."""

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


def ddp_sync_reports() -> None:
    """check_grad_sync under DDP: after an unrouted step every compared gradient differs (and the table says
    so); after a routed step none does."""
    wrapped = WRAPPERS["ddp"].build(build_model(CONFIG), {})
    batch = make_batch(CASE, CONFIG, dist.get_rank(), 0, 0)
    CASE.compute(wrapped.inner, batch, {}).backward()  # type: ignore[arg-type]
    report = check_grad_sync(wrapped.model)
    assert report.differing == report.compared > 0, f"unrouted: {report.differing} of {report.compared} differ"
    assert "params differing" in report.table(), f"the unrouted report's table: {report.table()}"
    wrapped.inner.zero_grad(set_to_none=True)
    route_loss(wrapped.model, wrapped.inner, CASE.compute, wrapped.inner, batch, {}).backward()
    report = check_grad_sync(wrapped.model)
    assert report.differing == 0 and report.compared > 0, f"routed: {report.differing} of {report.compared} differ"


def sharded_sync_report(wrapper: str) -> None:
    """check_grad_sync under a sharding wrapper after a routed step: nothing compared, and the note says so."""
    wrapped = WRAPPERS[wrapper].build(build_model(CONFIG), {})
    batch = make_batch(CASE, CONFIG, dist.get_rank(), 0, 0)
    route_loss(wrapped.model, wrapped.inner, CASE.compute, wrapped.inner, batch, {}).backward()
    report = check_grad_sync(wrapped.model)
    assert report.compared == 0, f"{wrapper}: {report.compared} sharded gradients compared"
    assert "not compared" in report.note, f"{wrapper}: the note does not say what is not compared: {report.note!r}"


def guard_verdicts() -> None:
    """The guard raises on the unrouted DDP step and stays silent on normal, routed and no_sync steps (local on
    purpose inside no_sync), and after a caught step (no stale state); with ``on_error="warn"`` it warns once per
    unrouted backward."""
    wrapped = WRAPPERS["ddp"].build(build_model(CONFIG), {})
    model, inner = wrapped.model, wrapped.inner
    batch = make_batch(CASE, CONFIG, dist.get_rank(), 0, 0)

    def attempt(name: str, expected: str, step: Any, ctx: Any = contextlib.nullcontext) -> None:
        """``expected``: "ok", or how the GradSyncError's message begins."""
        try:
            with guard(model), ctx():
                step().backward()
            verdict = "ok"
        except GradSyncError as error:
            verdict = "caught: " + str(error)[:60]
        model.zero_grad(set_to_none=True)
        fits = verdict == "ok" if expected == "ok" else verdict.startswith(f"caught: {expected}")
        assert fits, f"the {name} step: guard said {verdict!r}, expected {expected!r}"

    def normal() -> Any:  # the model called through the wrapper, loss from its output
        hidden = model(batch["input_ids"])
        return (hidden @ inner.lm_head.weight.t()).logsumexp(-1).mean()

    attempt("normal", "ok", normal)
    attempt("routed", "ok", lambda: route_loss(model, inner, CASE.compute, inner, batch, {}))
    attempt("no_sync_routed", "ok", lambda: route_loss(model, inner, CASE.compute, inner, batch, {}), model.no_sync)
    attempt("no_sync_unrouted", "ok", lambda: CASE.compute(inner, batch, {}), model.no_sync)
    attempt("unrouted", "gradients of a TinyCausalLM", lambda: CASE.compute(inner, batch, {}))
    attempt("routed_after", "ok", lambda: route_loss(model, inner, CASE.compute, inner, batch, {}))
    for name, expected, step in (("warn_unrouted", 1, lambda: CASE.compute(inner, batch, {})),
                                 ("warn_routed_after", 0,
                                  lambda: route_loss(model, inner, CASE.compute, inner, batch, {}))):  # fmt: skip
        with warnings.catch_warnings(record=True) as caught, guard(model, on_error="warn"):
            warnings.simplefilter("always")
            step().backward()
        said = sum("without DDP's forward" in str(w.message) for w in caught)
        assert said == expected, f"the {name} step warned {said} times, not {expected}"
        model.zero_grad(set_to_none=True)


def adapter_after_fully_shard(sync: str, compared: int, differing: int | None, note: str | None = None) -> None:
    """check_grad_sync after one step of tests/audit_scripts/adapters.py's model: a low-rank adapter added after
    ``fully_shard`` beside a frozen sharded base; ``sync``: "none", "hand" (gradients averaged by hand) or
    "shard" (the adapter sharded too). The report compares ``compared`` gradients, ``differing`` of them differ
    (None: not checked), and its note holds ``note`` (where given)."""
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
    said = f"sync={sync}: {report.differing} of {report.compared} differ ({report.note!r})"
    assert report.compared == compared, f"{said}; {compared} should be compared"
    assert differing is None or report.differing == differing, f"{said}; {differing} should differ"
    assert note is None or note in report.note, f"{said}; the note should say {note!r}"
