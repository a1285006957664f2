"""Rank bodies for tests/test_reliability.py: concurrent routing from two threads of each rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rankside_reliability import CONFIG, snapshot
from wrapperroute import route_loss
from wrapperroute.check.cell import differing_across_ranks
from wrapperroute.check.losses import LOSSES, make_batch
from wrapperroute.check.models import build_model
from wrapperroute.check.wrappers import WRAPPERS


def _threads(*workers: Any) -> list[Any]:
    import threading

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


def threads_cases() -> dict[str, Any]:
    """Concurrent routing from two threads of each rank.
    - two DDP models on two process groups, both with grad: each exact;
    - one DDP model, a training thread (grad) and an evaluation thread (no_grad) inside the forward at once:
      training exact, evaluation value correct;
    - one DDP model, two grad-enabled threads inside the forward at once: one RouteStateError, the other
      completes, the forward restored;
    - one FSDP2 model, two threads at once: one RouteStateError."""
    import threading

    from torch.nn.parallel import DistributedDataParallel as DDP


    case = LOSSES["fused_ce"]
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}

    # two models, two groups (one group would interleave the two reducers' all-reduces differently per rank)
    groups = [dist.new_group(), dist.new_group()]
    models = [build_model(CONFIG, seed=i) for i in range(2)]
    refs = [build_model(CONFIG, seed=i) for i in range(2)]
    ddps = [DDP(m, process_group=g) for m, g in zip(models, groups, strict=True)]
    barrier = threading.Barrier(2, timeout=30)

    def train(i: int) -> float:
        batch = make_batch(case, CONFIG, rank, i, 0)

        def fn() -> torch.Tensor:
            barrier.wait()  # both threads inside their wrapper's forward together
            return case.compute(models[i], batch, {})  # type: ignore[arg-type]

        route_loss(ddps[i], models[i], fn).backward()
        return 0.0

    results = _threads(lambda: train(0), lambda: train(1))
    worst, differ = 0.0, 0
    for i in range(2):
        grads = {n: p.grad.detach().clone() for n, p in models[i].named_parameters()}
        differ += differing_across_ranks(grads)[0]
        batches = [make_batch(case, CONFIG, r, i, 0) for r in range(world)]
        case.compute(refs[i], case.concat(batches), {}).backward()  # type: ignore[arg-type]
        worst = max(worst, max(float((grads[n] - p.grad).abs().max()) for n, p in refs[i].named_parameters()))
    out["two_models"] = {"errors": [repr(r) for r in results if r is not None and r != 0.0], "differ": differ,
                         "max_ref_diff": worst, "forward_left": any("forward" in m.__dict__ for m in models)}

    # one model: train (grad) + evaluate (no_grad) concurrently. The evaluation enters first and is still
    # running its loss when the training step starts: the training call must still get DDP's real forward
    # (the evaluation's "wrapper call inside the loss = plain call" applies to the evaluation's thread only).
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
    batches = [make_batch(case, CONFIG, r, 0, 0) for r in range(world)]
    case.compute(ref, case.concat(batches), {}).backward()  # type: ignore[arg-type]
    with torch.no_grad():
        expected_eval = case.compute(build_model(CONFIG), eval_batch, {})  # type: ignore[arg-type]
    out["train_and_eval"] = {
        "errors": [repr(r) for r in results if not isinstance(r, torch.Tensor)],
        "differ": differing_across_ranks(grads)[0],
        "max_ref_diff": max(float((grads[n] - p.grad).abs().max()) for n, p in ref.named_parameters()),
        "eval_diff": float((results[1] - expected_eval).abs()) if isinstance(results[1], torch.Tensor) else None,
        "forward_left": "forward" in model.__dict__,
    }

    # one model, two grad-enabled forwards at once: a clear error for the second, the first completes
    for wrapper in ("ddp", "fsdp2"):
        out[f"two_grad_{wrapper}"] = _two_grad(wrapper)
    out["train_beside_eval_replicate"] = _train_beside_eval("replicate")
    for group in groups:
        dist.destroy_process_group(group)
    # Overlapping DDP forwards may leave DDP's class-wide marker stale; routing clears it (adapters/ddp.py).
    with torch.no_grad():
        route_loss(ddp, model, lambda: None)
    out["marker_left"] = DDP._active_ddp_module is not None
    return out


def _two_grad(wrapper: str) -> dict[str, Any]:
    import threading

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
    if isinstance(results[0], torch.Tensor):
        wrapped.backward(results[0])
    after = snapshot(wrapped)
    return {
        "first_ok": isinstance(results[0], torch.Tensor),
        "errors": ["RouteStateError" if isinstance(e, RouteStateError) else type(e).__name__ for e in errors],
        "message": str(errors[-1]) if errors else "",
        "all": [repr(e)[:400] for e in errors],
        "differ": differing_across_ranks(wrapped.full_grads())[0],
        "clean": not after["target_forward"] and not after["in_forward"],
    }


def _train_beside_eval(wrapper: str) -> dict[str, Any]:
    """A wrapper whose hooks are set aside while a loss runs (``replicate``): an evaluation (no_grad) enters
    first, a training step enters while it runs, the evaluation leaves first. Both calls had the hooks aside at
    once; after them, and after one more step, the hooks are all back and the gradients in sync."""
    import threading

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
    return {
        "errors": [repr(r)[:400] for r in results if not isinstance(r, torch.Tensor)],
        "hooks": (hooks_before, hooks_after),
        "differ": differing_across_ranks(wrapped.full_grads())[0],
    }
