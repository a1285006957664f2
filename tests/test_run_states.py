"""Routing and its reports after what a real run goes through between steps: a plain forward that raised (the
bad batch a loop skips), NaN on one rank, a process group destroyed and made again, hooks a loss registers."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import rankside_run_states
import torch
import torch.distributed as dist

from wrapperroute import route_loss
from wrapperroute._groups import collective_device
from wrapperroute.ranks import RankPool

NEEDS_DS = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")


@pytest.mark.parametrize(
    ("wrapper", "opts", "step_after"),
    [
        pytest.param("ddp", {}, True, id="ddp"),
        # FSDP1 natively loses an optimizer step taken after a forward that raised (the original parameters it
        # steps are the failed forward's unsharded views, without gradients): the step comes before the raise
        pytest.param("fsdp1", {}, False, id="fsdp1"),
        pytest.param("fsdp2", {"groups": "layers"}, True, id="fsdp2"),
        pytest.param("zero3", {"zero": {"stage3_param_persistence_threshold": 0}}, True, id="zero3", marks=NEEDS_DS),
    ],
)
def test_a_plain_forward_that_raised_then_exact(
    pool: RankPool, wrapper: str, opts: dict[str, Any], step_after: bool
) -> None:
    """The raised forward leaves FSDP1's, FSDP2's and ZeRO-3's own "in forward" mark set (checked: the
    premise) and, FSDP's, the parameters it gathered in place; an optimizer step makes those stale. The next
    routed steps still run inside the wrapper's forward, on the parameters the optimizer holds: exact."""
    # asserted in each rank, where the steps are taken and measured
    pool.run(rankside_run_states.raised_forward_then_exact, wrapper, opts, step_after)


def test_check_grad_sync_compares_values_as_they_are(pool: RankPool) -> None:
    pool.run(rankside_run_states.nan_and_dtype_reports)


def test_agree_after_the_process_group_is_made_again(tmp_path: Path) -> None:
    """In ranks of its own: libraries cache groups of the default group they were made under (DeepSpeed's
    data-parallel groups do), which would break the suite's shared ranks after it."""
    with RankPool(2) as ranks:
        ranks.run(rankside_run_states.agree_after_new_process_group, str(tmp_path / "store"))


def test_the_unrouted_warning_points_at_the_callers_line(pool: RankPool) -> None:
    pool.run(rankside_run_states.unrouted_warning_lines)


# --- one process, one rank -------------------------------------------------------------------------------------


@pytest.mark.parametrize("wrapper", ["fsdp2", "replicate"])
def test_a_hook_the_loss_registers_is_kept(one_rank: None, wrapper: str) -> None:
    """A loss that registers a forward hook on the root it runs in (a metric, a probe): the hook stays
    registered after the loss, fires on the next forward, and its handle removes it."""
    from torch.distributed.device_mesh import init_device_mesh

    from wrapperroute.check.wrap_fsdp import fsdp2_api

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    if wrapper == "fsdp2":
        fsdp2_api().fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    else:
        from torch.distributed._composable.replicate import replicate

        replicate(model)
    calls: list[int] = []
    handles = []

    def loss(x: torch.Tensor) -> torch.Tensor:
        out = model(x).sum()
        handles.append(model.register_forward_hook(lambda *_: calls.append(1)))
        return out

    x = torch.randn(2, 4)
    route_loss(model, model, loss, x).backward()
    seen = len(calls)  # as natively, a hook registered during a forward may fire at that forward's end
    assert len(handles) == 1 and seen <= 1, f"{len(handles)} hooks registered, fired {seen} times in the loss"
    model(x).sum().backward()
    assert len(calls) == seen + 1, "the hook registered inside the loss was dropped"
    handles[0].remove()
    model(x).sum().backward()
    assert len(calls) == seen + 1, f"the hook fired {len(calls) - seen - 1} times after its handle removed it"


def test_collective_device_reads_the_backend_config(one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gloo group (real) takes CPU tensors; torch's default ``cpu:gloo,cuda:nccl`` too (its CPU backend);
    only a group without a CPU backend takes the accelerator's (the configs below are what torch reports; no GPU
    here, so the last two are read from a stand-in)."""
    found = collective_device(dist.group.WORLD)
    assert found == torch.device("cpu"), f"a gloo group's collectives on {found}"
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    found = collective_device()
    assert found == torch.device("cpu"), f"cpu:gloo,cuda:nccl's collectives on {found}"
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    found = collective_device()
    assert found == torch.device("cuda", 3), f"cuda:nccl's collectives on {found}, not the current device cuda:3"
