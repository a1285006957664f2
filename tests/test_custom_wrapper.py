"""A wrapper wrapperroute does not ship, taught to it through ``register_adapter`` (examples/custom_wrapper.py): the
same gradient truth as the built-in wrappers, the same audit, the same divisor."""

from __future__ import annotations

import warnings

import pytest
import torch
from rankside_custom_wrapper import audited_run, example

from wrapperroute.ranks import RankPool


def one_process(module: object) -> tuple[dict[str, torch.Tensor], int]:
    """The first step's gradients of the mean over every valid token of both ranks' batches, in one process."""
    config = module.TinyConfig()  # type: ignore[attr-defined]
    model = module.build_model(config)  # type: ignore[attr-defined]
    batches = [module.batch(config, rank, 0) for rank in (0, 1)]  # type: ignore[attr-defined]
    count = sum(int((labels != -100).sum()) for _, labels in batches)
    loss = sum(module.summed_loss(model, ids, labels) for ids, labels in batches) / count  # type: ignore[attr-defined]
    loss.backward()
    return {name: param.grad for name, param in model.named_parameters()}, count


def test_a_hand_rolled_wrapper_routed_exact_audited_and_counted(pool: RankPool) -> None:
    """Routed: every gradient identical across ranks and within 1e-6 of one process on the global batch (every
    rank a different number of valid tokens), the divisor the global count over the 2 ranks averaged, the audit
    in sync. Unrouted: the ranks' gradients differ from each other and from the truth, and the audit says DESYNC
    at the first step."""
    module = example()
    truth, count = one_process(module)
    routed = pool.run(audited_run, True)
    unrouted = pool.run(audited_run, False)
    counts = {int((module.batch(module.TinyConfig(), rank, 0)[1] != -100).sum()) for rank in (0, 1)}
    assert len(counts) == 2, f"the premise: uneven valid tokens per rank, got {counts}"
    for rank, result in enumerate(routed):
        assert result["differing"] == [0, 0, 0], f"rank {rank}, routed: gradients differ across ranks"
        assert result["divisors"][0] == pytest.approx(count / 2, abs=0), result["divisors"]
        worst = max((result["first_grads"][name] - grad).abs().max().item() for name, grad in truth.items())
        assert worst <= 1e-6, f"rank {rank}, routed: {worst:.3g} from one process on the global batch"
        # the audit compares every wrapper alive in the process: this pool's ranks may keep one of an earlier test
        assert not result["desync"] and "allreduce_dp" in result["kinds"], result["final"]
        assert result["final"].startswith("wrapperroute audit: in sync"), result["final"]
    params = len(truth)
    for rank, result in enumerate(unrouted):
        assert result["differing"] == [params] * 3, f"rank {rank}, unrouted: {result['differing']} of {params} differ"
        worst = max((result["first_grads"][name] - grad).abs().max().item() for name, grad in truth.items())
        assert worst > 1e-3, f"rank {rank}, unrouted: only {worst:.3g} from the truth; the test shows nothing"
        final = result["final"]
        assert result["desync"] and "DESYNC" in final and "first at step 1" in final, final


def test_register_adapter_refuses_what_it_cannot_use(adapters_kept: None) -> None:
    """Bad arguments raise an error that says what to pass, and change nothing."""
    from wrapperroute import RouteTypeError, RouteValueError, register_adapter
    from wrapperroute.adapters import registered

    module = example()
    before = registered()
    for bad, error, said in (
        (module.AllReduceDPAdapter, RouteTypeError, r"AllReduceDPAdapter\(\)"),
        (object(), RouteTypeError, "Layer instance"),
        ("custom_wrapper.AllReduceDPAdapter", RouteValueError, "module:Class"),
    ):
        with pytest.raises(error, match=said):
            register_adapter(bad)
    with pytest.raises(RouteValueError, match="once_imported"):
        register_adapter(module.AllReduceDPAdapter(), once_imported="torch")
    assert registered() == before, "a refused registration changed the adapters"


def test_a_later_registration_is_asked_first_and_forgets_what_was_planned(adapters_kept: None) -> None:
    """A module no adapter claimed is planned as plain; registered later, an adapter claiming its type is asked
    first (before the built-in DDP adapter, for a DDP subclass) and the module is looked at again."""
    from torch.nn.parallel import DistributedDataParallel

    from wrapperroute import detect, register_adapter
    from wrapperroute.adapters import registered
    from wrapperroute.adapters.ddp import DDPAdapter

    module = example()

    class Shell(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = torch.nn.Linear(2, 2)

    shell = Shell()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one process: nothing to warn of
        assert detect(shell).kind == "none"

    class ShellAdapter(module.AllReduceDPAdapter):  # type: ignore[name-defined,misc]
        kind = "shell"

        def claims(self, candidate: torch.nn.Module) -> bool:
            return isinstance(candidate, Shell | DistributedDataParallel)

    register_adapter(ShellAdapter())
    assert isinstance(registered()[0], ShellAdapter) and any(isinstance(a, DDPAdapter) for a in registered())
    assert detect(shell).kind == "shell", "a type remembered as plain was not looked at again"


@pytest.fixture
def adapters_kept() -> object:
    """The registered adapters as they were before the test, put back after it."""
    from wrapperroute.adapters import registry

    saved = list(registry._entries)
    yield None
    registry._entries[:] = saved
    registry._changed()
