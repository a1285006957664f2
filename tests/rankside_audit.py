"""Rank bodies for tests/test_audit.py: the audit's cross-rank comparison on real gloo ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from wrapperroute.adapters import Replica
from wrapperroute.crossrank import Exchange, Outcome, compare_later, replica_rows


def compare(replicas: list[Replica], side: Any, grads_of: set[int], params: bool, exchange: Exchange | None = None,
            window: tuple[int, int] | None = None) -> Outcome:  # fmt: skip
    """What the audit does for one comparison: the replicas' rows, compared on ``side``."""
    rows = replica_rows(replicas, params=params, grads_of=grads_of, window=window)
    return compare_later(rows, side, exchange=exchange, slot=params).result()


def compare_replicas(differ_at: str | None, extra_on_rank: int | None) -> dict[str, Any]:
    """Three replicated parameters with gradients (equal on every rank unless ``differ_at`` names one, which
    rank 1 perturbs by 0.5); ``extra_on_rank``: that rank alone holds a fourth (the ranks' key lists differ)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    params = {name: torch.nn.Parameter(torch.randn(64, 8)) for name in ("a", "b", "c", "d")}
    for param in params.values():
        param.grad = torch.randn_like(param)
    if differ_at is not None and rank == 1:
        with torch.no_grad():
            params[differ_at].grad.add_(0.5)
    names = ["a", "b", "c"] + (["d"] if rank == extra_on_rank else [])
    found = [Replica(f"ddp[0].{n}", params[n], (0, 1), True) for n in names]
    side = dist.new_group(backend="gloo")
    finding = compare(found, side, {id(p) for p in params.values()}, params=True)
    dist.destroy_process_group(side)
    return {"compared": finding.compared,
            "differences": [(d.name, d.what, d.max_abs_diff) for d in finding.mismatches]}  # fmt: skip


def collectives_per_comparison(rounds: int) -> dict[str, Any]:
    """The same comparison ``rounds`` times with one exchange (as an audited run does), then once with the
    rows changed on rank 1: the collectives each call ran, and what each found."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    params = {name: torch.nn.Parameter(torch.randn(16, 4)) for name in ("a", "b", "c")}
    for param in params.values():
        param.grad = torch.randn_like(param)
    side = dist.new_group(backend="gloo")
    exchange = Exchange()
    counted = {"calls": 0}
    gather, gather_object = dist.all_gather, dist.all_gather_object

    def counting(original: Any) -> Any:
        def collective(*args: Any, **kwargs: Any) -> Any:
            counted["calls"] += 1
            return original(*args, **kwargs)

        return collective

    dist.all_gather, dist.all_gather_object = counting(gather), counting(gather_object)  # type: ignore[assignment]
    calls, found = [], []
    try:
        for round_ in range(rounds + 1):
            names = ["a", "b", "c"] if round_ < rounds or rank == 0 else ["a", "b"]
            replicas = [Replica(f"ddp[0].{n}", params[n], (0, 1), True) for n in names]
            before = counted["calls"]
            finding = compare(replicas, side, {id(p) for p in params.values()}, params=False, exchange=exchange)
            calls.append(counted["calls"] - before)
            found.append(len(finding.mismatches))
    finally:
        dist.all_gather, dist.all_gather_object = gather, gather_object  # type: ignore[assignment]
        dist.destroy_process_group(side)
    return {"calls": calls, "found": found}


def compare_in_windows(position: int) -> dict[str, Any]:
    """One large gradient that differs at one ``position`` on rank 1 (by 0.5): what a comparison finds reading
    each eighth of it in turn, and reading it whole."""
    rank = dist.get_rank()
    param = torch.nn.Parameter(torch.zeros(1 << 17))
    param.grad = torch.ones_like(param)
    if rank == 1:
        with torch.no_grad():
            param.grad[position] += 0.5
    replica = [Replica("ddp[0].big", param, (0, 1), True)]
    side = dist.new_group(backend="gloo")
    found = {}
    for window in [*((part, 8) for part in range(8)), None]:
        finding = compare(replica, side, {id(param)}, params=False, window=window)
        found[str(window)] = [(d.what, d.max_abs_diff) for d in finding.mismatches]
    dist.destroy_process_group(side)
    return found


def step_that_raises() -> dict[str, Any]:
    """An audited DDP run whose optimizer's first step raises inside (after the audit's pre-step hook started
    a comparison, so its post-step hook never runs); the script goes on: the comparison is finished at the
    next step, every rank in the same order, and the run ends with every checkpoint recorded."""
    from torch.nn.parallel import DistributedDataParallel

    from wrapperroute.audit import Audit

    class FailsOnce(torch.optim.Optimizer):
        """Plain SGD whose first step raises (torch wraps ``step`` with the global hooks itself)."""

        failed = False

        def __init__(self, params: Any) -> None:
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self, closure: Any = None) -> Any:
            if not FailsOnce.failed:
                FailsOnce.failed = True
                raise RuntimeError("the optimizer's own failure")
            for group in self.param_groups:
                for param in group["params"]:
                    param.add_(param.grad, alpha=-group["lr"])

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 8))
    optimizer = FailsOnce(model.parameters())
    audit = Audit(None, "warn", None)
    audit.install()
    raised = []
    try:
        for _ in range(3):
            model(torch.randn(2, 8)).sum().backward()
            try:
                optimizer.step()
            except RuntimeError as error:
                raised.append(str(error))
            optimizer.zero_grad()
        audit.finish()
    finally:
        audit.uninstall()
    return {"raised": raised, "labels": [c.label for c in audit.checkpoints], "desync": audit.desync}
