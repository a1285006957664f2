"""Rank bodies for tests/test_audit.py: the audit's cross-rank comparison on real gloo ranks, each asserting what
the comparison found where it is found."""

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


def compare_replicas(differ_at: str | None, extra_on_rank: int | None, expected: list[tuple[str, str, float]]) -> None:
    """Three replicated parameters with gradients (equal on every rank unless ``differ_at`` names one, which
    rank 1 perturbs by 0.5); ``extra_on_rank``: that rank alone holds a fourth (the ranks' key lists differ).
    Every row this rank holds is compared (parameter and gradient), and the differences found are ``expected``
    (name, what, difference to 1e-6): a key only one rank holds has no copy to be compared with."""
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
    keys = len(names)
    assert finding.compared == 2 * keys, f"{finding.compared} rows compared for {keys} keys' parameters and gradients"
    found = [(d.name, d.what, d.max_abs_diff) for d in finding.mismatches]
    assert len(found) == len(expected) and all(
        (name, what) == (want_name, want_what) and abs(diff - want) <= 1e-6
        for (name, what, diff), (want_name, want_what, want) in zip(found, expected, strict=False)
    ), f"found {found}, expected {expected}"


def collectives_per_comparison(rounds: int, calls_expected: list[int]) -> None:
    """The same comparison ``rounds`` times with one exchange (as an audited run does), then once with the
    rows changed on rank 1: each call ran ``calls_expected`` collectives, and none found a difference."""
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
    try:
        for round_ in range(rounds + 1):
            names = ["a", "b", "c"] if round_ < rounds or rank == 0 else ["a", "b"]
            replicas = [Replica(f"ddp[0].{n}", params[n], (0, 1), True) for n in names]
            before = counted["calls"]
            finding = compare(replicas, side, {id(p) for p in params.values()}, params=False, exchange=exchange)
            calls = counted["calls"] - before
            assert calls == calls_expected[round_], f"comparison {round_} ran {calls} collectives: {calls_expected}"
            assert not finding.mismatches, f"comparison {round_} found differences: {finding.mismatches}"
    finally:
        dist.all_gather, dist.all_gather_object = gather, gather_object  # type: ignore[assignment]
        dist.destroy_process_group(side)


def compare_in_windows(position: int, holder: tuple[int, int]) -> None:
    """One large gradient that differs at one ``position`` on rank 1 (by 0.5): a comparison reading each eighth
    of it in turn finds the difference (measured on the whole tensor) in the eighth ``holder`` only, and reading
    it whole finds it at once."""
    rank = dist.get_rank()
    param = torch.nn.Parameter(torch.zeros(1 << 17))
    param.grad = torch.ones_like(param)
    if rank == 1:
        with torch.no_grad():
            param.grad[position] += 0.5
    replica = [Replica("ddp[0].big", param, (0, 1), True)]
    side = dist.new_group(backend="gloo")
    for window in [*((part, 8) for part in range(8)), None]:
        finding = compare(replica, side, {id(param)}, params=False, window=window)
        found = [(d.what, d.max_abs_diff) for d in finding.mismatches]
        expected = [("gradient", 0.5)] if window in (holder, None) else []
        assert found == expected, f"reading the window {window} of 8 found {found}, expected {expected}"
    dist.destroy_process_group(side)


def step_that_raises() -> None:
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
    assert raised == ["the optimizer's own failure"], f"the optimizer's steps raised {raised}"
    labels = [c.label for c in audit.checkpoints]
    assert labels == ["before step 1", "step 1", "step 2", "step 3", "end"], f"the checkpoints recorded: {labels}"
    assert not audit.desync, f"the audit found a desync: {audit.desync}"
