"""Rank bodies for tests/test_reliability.py: concurrent routing from two threads of each rank, one function a
case. Overlapping DDP forwards in two threads may leave DDP's class-wide forward marker stale: after each DDP
case, the next routed call must clear it (adapters/ddp.py)."""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rankside_reliability import CONFIG, snapshot
from wrapperroute import route_loss
from wrapperroute.check.cell import REFERENCE_TOLERANCE, differing_across_ranks
from wrapperroute.check.losses import LOSSES, make_batch
from wrapperroute.check.models import build_model
from wrapperroute.check.wrappers import WRAPPERS


def _threads(*workers: Any) -> list[Any]:
    results: list[Any] = [None] * len(workers)

    def run(index: int) -> None:
        try:
            results[index] = workers[index]()
        except Exception as error:
            results[index] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(workers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def _raised(results: list[Any]) -> list[str]:
    return [repr(r)[:400] for r in results if isinstance(r, Exception)]


def _no_marker_after_a_route(ddp: nn.Module, model: nn.Module, after: str) -> None:
    """A routed no-grad call clears DDP's forward marker if the threads left it stale."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    with torch.no_grad():
        route_loss(ddp, model, lambda: None)
    left = DDP._active_ddp_module
    assert left is None, f"after {after}, a routed call left DDP's forward marker set (on a {type(left).__name__})"


def two_models_with_grad() -> None:
    """Two DDP models on two process groups, one thread each, both with grad and inside their wrapper's forward
    together: each exact (one group would interleave the two reducers' all-reduces differently per rank)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    case = LOSSES["fused_ce"]
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group(), dist.new_group()]
    models = [build_model(CONFIG, seed=i) for i in range(2)]
    refs = [build_model(CONFIG, seed=i) for i in range(2)]
    ddps = [DDP(m, process_group=g) for m, g in zip(models, groups, strict=True)]
    barrier = threading.Barrier(2, timeout=30)

    def train(i: int) -> None:
        batch = make_batch(case, CONFIG, rank, i, 0)

        def fn() -> torch.Tensor:
            barrier.wait()  # both threads inside their wrapper's forward together
            return case.compute(models[i], batch, {})  # type: ignore[arg-type]

        route_loss(ddps[i], models[i], fn).backward()

    errors = _raised(_threads(lambda: train(0), lambda: train(1)))
    assert not errors, f"a training thread raised: {errors}"
    for i in range(2):
        grads = {n: p.grad.detach().clone() for n, p in models[i].named_parameters()}
        differ = differing_across_ranks(grads)[0]
        batches = [make_batch(case, CONFIG, r, i, 0) for r in range(world)]
        case.compute(refs[i], case.concat(batches), {}).backward()  # type: ignore[arg-type]
        worst = max(float((grads[n] - p.grad).abs().max()) for n, p in refs[i].named_parameters())
        assert differ == 0, f"model {i}: {differ} parameters' gradients differ across ranks"
        assert worst <= REFERENCE_TOLERANCE, f"model {i}: gradients {worst:.3g} from one process's on the global batch"
    left = [i for i, m in enumerate(models) if "forward" in m.__dict__]
    assert not left, f"models {left} kept an instance forward"
    _no_marker_after_a_route(ddps[0], models[0], "two DDP forwards overlapping in two threads")
    for group in groups:
        dist.destroy_process_group(group)


def train_and_evaluate_one_model() -> None:
    """One DDP model, a training thread (grad) and an evaluation thread (no_grad) inside the forward at once:
    training exact, the evaluation's value correct. The evaluation enters first and is still running its loss
    when the training step starts: the training call must still get DDP's real forward (the evaluation's
    "wrapper call inside the loss = plain call" applies to the evaluation's thread only)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    case = LOSSES["fused_ce"]
    rank, world = dist.get_rank(), dist.get_world_size()
    model, ref = build_model(CONFIG), build_model(CONFIG)
    ddp = DDP(model)
    eval_inside, train_inside = threading.Event(), threading.Event()
    train_batch, eval_batch = make_batch(case, CONFIG, rank, 0, 0), make_batch(case, CONFIG, rank, 5, 0)

    def evaluate(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        eval_inside.set()
        train_inside.wait(30)
        return case.compute(model, batch, {})  # type: ignore[arg-type]

    def train_loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        train_inside.set()
        return case.compute(model, batch, {})  # type: ignore[arg-type]

    def trainer() -> torch.Tensor:
        eval_inside.wait(30)
        loss = route_loss(ddp, model, train_loss, train_batch)
        loss.backward()
        return loss.detach()

    def evaluator() -> torch.Tensor:
        with torch.no_grad():
            return route_loss(ddp, model, evaluate, eval_batch)

    results = _threads(trainer, evaluator)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    differ = differing_across_ranks(grads)[0]
    batches = [make_batch(case, CONFIG, r, 0, 0) for r in range(world)]
    case.compute(ref, case.concat(batches), {}).backward()  # type: ignore[arg-type]
    worst = max(float((grads[n] - p.grad).abs().max()) for n, p in ref.named_parameters())
    with torch.no_grad():
        expected_eval = case.compute(build_model(CONFIG), eval_batch, {})  # type: ignore[arg-type]
    errors = [repr(r)[:400] for r in results if not isinstance(r, torch.Tensor)]
    assert not errors, f"a thread did not return its loss: {errors}"
    assert differ == 0, f"training beside an evaluation: {differ} parameters' gradients differ across ranks"
    assert worst <= REFERENCE_TOLERANCE, f"training beside an evaluation: gradients {worst:.3g} from one process's"
    eval_diff = float((results[1] - expected_eval).abs())
    assert eval_diff <= REFERENCE_TOLERANCE, f"the evaluation's loss is {eval_diff:.3g} from one process's"
    assert "forward" not in model.__dict__, "the model kept an instance forward"
    _no_marker_after_a_route(ddp, model, "a training and an evaluation forward overlapping in two threads")


def two_grad_forwards(wrapper: str) -> None:
    """One model, two grad-enabled threads inside the forward at once: a RouteStateError for the second that
    says what to do, the first completes, in sync, and the forward is restored."""
    from wrapperroute import RouteStateError

    case = LOSSES["fused_ce"]
    wrapped = WRAPPERS[wrapper].build(build_model(CONFIG), {})
    inner: Any = wrapped.inner
    entered, release = threading.Event(), threading.Event()
    batch = make_batch(case, CONFIG, dist.get_rank(), 0, 0)

    def first() -> Any:
        def fn() -> torch.Tensor:
            entered.set()
            release.wait(30)  # hold the forward open until the second thread has tried
            return case.compute(inner, batch, {})

        return route_loss(wrapped.model, inner, fn)

    def second() -> Any:
        entered.wait(30)
        try:
            return route_loss(wrapped.model, inner, case.compute, inner, batch, {})
        finally:
            release.set()

    results = _threads(first, second)
    errors = [r for r in results if isinstance(r, Exception)]
    first_ok = isinstance(results[0], torch.Tensor)
    if first_ok:
        wrapped.backward(results[0])
    after = snapshot(wrapped)
    differ = differing_across_ranks(wrapped.full_grads())[0]
    kinds = ["RouteStateError" if isinstance(e, RouteStateError) else type(e).__name__ for e in errors]
    assert first_ok and kinds == ["RouteStateError"], f"first thread {results[0]!r}; raised: {_raised(results)}"
    message = str(errors[-1])
    assert "another thread" in message and "Serialise" in message, f"the error does not say what to do: {message}"
    assert differ == 0, f"the first thread's step: {differ} parameters' gradients differ across ranks"
    assert not after["target_forward"] and not after["in_forward"], f"the forward was not restored: {after}"
    if wrapper == "ddp":
        _no_marker_after_a_route(wrapped.model, inner, "a second grad-enabled forward refused")


def train_beside_eval(wrapper: str) -> None:
    """A wrapper whose hooks are set aside while a loss runs (``replicate``): an evaluation (no_grad) enters
    first, a training step enters while it runs, the evaluation leaves first. Both calls had the hooks aside at
    once; after them, and after one more step, the hooks are all back and the gradients in sync."""
    case = LOSSES["fused_ce"]
    wrapped = WRAPPERS[wrapper].build(build_model(CONFIG), {})
    model, inner = wrapped.model, wrapped.inner
    hooks_before = len(model._forward_pre_hooks) + len(model._forward_hooks)
    eval_inside, train_inside = threading.Event(), threading.Event()
    batch = make_batch(case, CONFIG, dist.get_rank(), 0, 0)

    def evaluator() -> Any:
        def fn() -> torch.Tensor:
            eval_inside.set()
            train_inside.wait(30)  # leaves while the training loss still runs
            return case.compute(inner, batch, {})

        with torch.no_grad():
            return route_loss(model, inner, fn)

    def trainer() -> Any:
        eval_inside.wait(30)

        def fn() -> torch.Tensor:
            train_inside.set()
            return case.compute(inner, batch, {})

        loss = route_loss(model, inner, fn)
        wrapped.backward(loss)
        return loss.detach()

    results = _threads(trainer, evaluator)
    hooks_after = len(model._forward_pre_hooks) + len(model._forward_hooks)
    for param in inner.parameters():
        param.grad = None
    step = make_batch(case, CONFIG, dist.get_rank(), 1, 0)
    wrapped.backward(route_loss(model, inner, case.compute, inner, step, {}))
    differ = differing_across_ranks(wrapped.full_grads())[0]
    errors = [repr(r)[:400] for r in results if not isinstance(r, torch.Tensor)]
    assert not errors, f"a thread did not return its loss: {errors}"
    assert hooks_before > 0, f"{wrapper} has no forward hooks to set aside: this proves nothing"
    assert hooks_after == hooks_before, f"{hooks_before} forward hooks before the overlapping calls, {hooks_after} now"
    assert differ == 0, f"the step after: {differ} parameters' gradients differ across ranks"
