"""Rank-side functions for the reliability tests (module level: the pool pickles them by reference).

Every expected exception is caught here and returned as data, so the happy path never restarts the pool.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from wrapperroute import detect, route_loss
from wrapperroute.check.cell import _compare_across_ranks, _max_diff
from wrapperroute.check.losses import LOSSES, make_batch
from wrapperroute.check.models import TinyConfig, build_model
from wrapperroute.check.wrappers import WRAPPERS, Wrapped, build_none

CONFIG = TinyConfig()
TOLERANCE = 1e-6
_HOOKS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def hook_count(module: nn.Module) -> int:
    return sum(len(getattr(m, name, ())) for m in module.modules() for name in _HOOKS)


def snapshot(wrapped: Wrapped) -> dict[str, Any]:
    """What routing must leave exactly as it found it."""
    found = detect(wrapped.model)
    assert found.wrapper is not None and found.adapter is not None
    target = found.adapter.redirect_target(found.wrapper)
    from torch.nn.parallel import DistributedDataParallel as DDP

    return {
        "sharded": _sharded(found.kind, found.wrapper),
        "target_forward": "forward" in target.__dict__,
        "wrapper_forward": found.wrapper is not target and "forward" in found.wrapper.__dict__,
        "hooks": hook_count(wrapped.model),
        "in_forward": found.adapter.in_forward(found.wrapper),
        "active_ddp": DDP._active_ddp_module is not None,
        "grad_enabled": torch.is_grad_enabled(),
    }


def _sharded(kind: str, wrapper: nn.Module) -> bool:
    """Every parameter is back in its between-steps layout (trivially so for replicated wrappers)."""
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        flats = [unit._handle.flat_param for unit in FSDP.fsdp_modules(wrapper) if unit._handle is not None]
        # before the first forward (lazy init) the flat parameter is its own shard
        return all(not hasattr(f, "_local_shard") or f.data_ptr() == f._local_shard.data_ptr() for f in flats)
    if kind in ("fsdp2", "replicate_fsdp"):
        from wrapperroute.check.wrap_fsdp import fsdp2_api

        DTensor = fsdp2_api().DTensor

        return all(isinstance(p, DTensor) for p in wrapper.parameters())
    if kind == "deepspeed" and wrapper.zero_optimization_stage() == 3:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        return all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in wrapper.module.parameters())
    return True


def truth_step(wrapped: Wrapped, reference: Wrapped, step: int, config: TinyConfig = CONFIG) -> dict[str, Any]:
    """One routed fused-CE step, then gradient truth against a single process on the global batch."""
    case = LOSSES["fused_ce"]
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = make_batch(case, config, rank, step, 0)
    loss = route_loss(wrapped.model, wrapped.inner, case.compute, wrapped.inner, batch, {})
    wrapped.backward(loss)
    grads = wrapped.full_grads()
    differ, _ = _compare_across_ranks(grads)
    batches = [make_batch(case, config, r, step, 0) for r in range(world)]
    (case.compute(reference.model, case.concat(batches), {}) * wrapped.loss_scale).backward()  # type: ignore[arg-type]
    ref_diff = _max_diff(grads, reference.full_grads())
    wrapped.step()
    reference.step()
    return {"differ": differ, "max_ref_diff": ref_diff, "params": len(grads)}


def build(wrapper: str, opts: dict[str, Any] | None = None, config: TinyConfig = CONFIG) -> tuple[Wrapped, Wrapped]:
    return WRAPPERS[wrapper].build(build_model(config), dict(opts or {})), build_none(build_model(config), {})


def fault_then_exact(wrapper: str, opts: dict[str, Any], interrupt: bool = False) -> dict[str, Any]:
    """fn raises on every rank after reading parameters (a ValueError, or KeyboardInterrupt): the wrapper is
    back in its between-steps state, and the same model's next two steps are exact."""
    wrapped, reference = build(wrapper, opts)
    inner: Any = wrapped.inner
    before = snapshot(wrapped)
    ids = make_batch(LOSSES["fused_ce"], CONFIG, dist.get_rank(), 0, 0)["input_ids"]

    def failing() -> torch.Tensor:
        hidden = inner(ids)
        _ = hidden @ inner.lm_head.weight.t()
        if interrupt:
            raise KeyboardInterrupt("boom inside the loss")
        raise ValueError("boom inside the loss")

    raised = None
    try:
        route_loss(wrapped.model, wrapped.inner, failing)
    except (ValueError, KeyboardInterrupt) as error:
        raised = f"{type(error).__name__}: {error}"
    after = snapshot(wrapped)
    steps = [truth_step(wrapped, reference, step) for step in range(2)]
    return {"raised": raised, "before": before, "after": after, "steps": steps, "end": snapshot(wrapped)}


def interrupt_anywhere(wrapper: str, opts: dict[str, Any]) -> dict[str, Any]:
    """KeyboardInterrupt at every point of a routed fused-CE call where CPython could raise one, every rank at
    the same point (tests/interrupt_points.py), the call under no_grad (an evaluation step: a training forward
    interrupted after it returned is an abandoned forward, whose aftermath is the wrapper's own). After each:
    the wrapper's between-steps state, and the next training step is exact."""
    from interrupt_points import count_points, interrupt_at

    wrapped, reference = build(wrapper, opts)
    case = LOSSES["fused_ce"]
    batch = make_batch(case, CONFIG, dist.get_rank(), 0, 0)
    steps = [truth_step(wrapped, reference, 0)]  # plans the model: later calls take the step's own path
    before = snapshot(wrapped)

    def call() -> Any:
        with torch.no_grad():
            return route_loss(wrapped.model, wrapped.inner, case.compute, wrapped.inner, batch, {})

    points = count_points(call)
    broken = []
    for point in range(1, points + 1):
        interrupted, where = interrupt_at(point, call)
        after = snapshot(wrapped)
        if not interrupted or after != before:
            changed = {key: value for key, value in after.items() if before.get(key) != value}
            broken.append({"point": point, "where": where, "interrupted": interrupted, "changed": changed})
            break
        steps.append(truth_step(wrapped, reference, point))
    return {"points": points, "broken": broken, "before": before, "steps": steps}


# --- one rank fails -----------------------------------------------------------------------------------------


def _fail_on(rank: int, inner: Any, ids: torch.Tensor) -> torch.Tensor:
    # Fails after every parameter read, like a NaN check on the loss: under ZeRO-3 each read is a gather, and
    # a rank failing before a read would leave the others in that gather (bounded by the group's timeout).
    loss = (inner(ids) @ inner.lm_head.weight.t()).float().logsumexp(-1).mean()
    if dist.get_rank() == rank:
        raise ValueError(f"only rank {rank} fails")
    return loss


def one_rank_fails_agreed(wrapper: str, opts: dict[str, Any]) -> dict[str, Any]:
    """route_loss(..., agree=True) with fn raising on rank 1 only: every rank raises RouteStateError naming
    rank 1 (the failed one chained to its own error), the wrapper is clean, and the next steps are exact."""
    from wrapperroute import RouteStateError

    wrapped, reference = build(wrapper, opts)
    ids = make_batch(LOSSES["fused_ce"], CONFIG, dist.get_rank(), 0, 0)["input_ids"]
    before = snapshot(wrapped)
    outcome: dict[str, Any] = {}
    try:
        route_loss(wrapped.model, wrapped.inner, _fail_on, 1, wrapped.inner, ids, agree=True)
        outcome["raised"] = None
    except RouteStateError as error:
        outcome.update(raised="RouteStateError", message=str(error), cause=type(error.__cause__).__name__)
    outcome["clean"] = snapshot(wrapped) == before
    # agree=True on a step where every rank succeeds: no error, and exact
    case = LOSSES["fused_ce"]
    batch = make_batch(case, CONFIG, dist.get_rank(), 0, 0)
    loss = route_loss(wrapped.model, wrapped.inner, case.compute, wrapped.inner, batch, {}, agree=True)
    wrapped.backward(loss)
    outcome["agreed_ok"] = _compare_across_ranks(wrapped.full_grads())[0] == 0
    wrapped.step()
    reference_loss = case.compute(reference.model, case.concat(
        [make_batch(case, CONFIG, r, 0, 0) for r in range(dist.get_world_size())]), {})  # type: ignore[arg-type]
    (reference_loss * wrapped.loss_scale).backward()
    reference.step()
    outcome["next"] = truth_step(wrapped, reference, 1)
    return outcome


def one_rank_fails_bounded(seconds: float) -> dict[str, Any]:
    """Without agree: DDP on a process group with a short timeout, fn raising on rank 1 only. Rank 1 gets its
    own error; rank 0 waits in the backward's all-reduce until the group's timeout, then raises. Nothing hangs
    forever: the bound is the process group's timeout."""
    import time
    from datetime import timedelta

    from torch.nn.parallel import DistributedDataParallel as DDP

    group = dist.new_group(timeout=timedelta(seconds=seconds))
    model = build_model(CONFIG)
    ddp = DDP(model, process_group=group)
    ids = make_batch(LOSSES["fused_ce"], CONFIG, dist.get_rank(), 0, 0)["input_ids"]
    start = time.perf_counter()
    outcome: dict[str, Any] = {}
    try:
        route_loss(ddp, model, _fail_on, 1, model, ids).backward()
        outcome["error"] = None
    except Exception as error:
        outcome["error"] = f"{type(error).__name__}: {str(error)[:300]}"
    outcome["seconds"] = time.perf_counter() - start
    outcome["forward_left"] = "forward" in model.__dict__
    del ddp
    dist.barrier()  # on the default group: the pool's own group is unharmed
    with contextlib.suppress(Exception):
        dist.destroy_process_group(group)
    return outcome


# --- bad input on real wrappers -----------------------------------------------------------------------------


class _Holder:
    """A loss inside an object DDP's output walk cannot see."""

    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss


def bad_input_cases() -> dict[str, dict[str, Any]]:
    """Mistakes made against a real DDP / FSDP2 model. For each: the exception (type, message), whether the
    wrapper is exactly as before (forward attributes, hook counts, layout), and a routed step on the same
    model afterwards (gradient truth)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    results: dict[str, dict[str, Any]] = {}
    ddp, ddp_ref = build("ddp", {"find_unused_parameters": True})
    fsdp2, fsdp2_ref = build("fsdp2", {"groups": "layers"})
    inner: Any = ddp.inner
    ids = make_batch(LOSSES["fused_ce"], CONFIG, dist.get_rank(), 0, 0)["input_ids"]
    other = DDP(build_model(CONFIG))

    def loss() -> torch.Tensor:
        return (inner(ids) @ inner.lm_head.weight.t()).logsumexp(-1).mean()

    async def async_loss() -> torch.Tensor:
        return loss()

    def generator_loss() -> Any:
        yield loss()

    cases: dict[str, tuple[Wrapped, Wrapped, Any]] = {
        "unwrapped-is-the-wrapper": (ddp, ddp_ref, lambda: route_loss(ddp.model, ddp.model, loss)),
        "unwrapped-of-another-model": (ddp, ddp_ref, lambda: route_loss(ddp.model, other.module, loss)),
        "gather-outside-fsdp2": (
            fsdp2, fsdp2_ref, lambda: route_loss(fsdp2.model, fsdp2.inner, loss, gather=[nn.Linear(2, 2)])
        ),
        "gather-by-name": (ddp, ddp_ref, lambda: route_loss(ddp.model, inner, loss, gather="lm_head")),
        "no-tensor-find-unused": (ddp, ddp_ref, lambda: route_loss(ddp.model, inner, lambda: _Holder(loss()))),
        "detached-find-unused": (ddp, ddp_ref, lambda: route_loss(ddp.model, inner, lambda: loss().detach())),
        "async-fn": (ddp, ddp_ref, lambda: route_loss(ddp.model, inner, async_loss)),
        "generator-fn": (ddp, ddp_ref, lambda: route_loss(ddp.model, inner, generator_loss)),
        "async-fn-fsdp2": (fsdp2, fsdp2_ref, lambda: route_loss(fsdp2.model, fsdp2.inner, async_loss)),
    }
    step = {"ddp": 0, "fsdp2": 0}
    for name, (wrapped, reference, call) in cases.items():
        before = snapshot(wrapped)
        entry: dict[str, Any] = {"error": None, "message": ""}
        try:
            call()
        except Exception as error:
            entry.update(error=type(error).__name__, message=str(error), mro=[c.__name__ for c in type(error).__mro__])
        entry["clean"] = snapshot(wrapped) == before
        kind = "ddp" if wrapped is ddp else "fsdp2"
        entry["after"] = truth_step(wrapped, reference, step[kind])
        step[kind] += 1
        results[name] = entry
    return results


def legit_cases() -> dict[str, dict[str, Any]]:
    """Uses that look odd but are legitimate, proved to route correctly:
    - under torch.no_grad() (an evaluation loss): FSDP1/FSDP2 still unshard (the loss value equals a single
      process's), DDP arms nothing, every wrapper is back to its layout, and the next grad step is exact;
    - a model in eval() mode: routed, modes untouched, gradients exact;
    - route_loss called from inside the wrapper's own forward: fn runs directly, the forward is entered once."""
    case = LOSSES["fused_ce"]
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, dict[str, Any]] = {}
    for wrapper, opts in (("ddp", {}), ("fsdp1", {"lm_head_unit": True}), ("fsdp2", {"groups": "layers"})):
        wrapped, reference = build(wrapper, opts)
        batch = make_batch(case, CONFIG, rank, 0, 0)
        before = snapshot(wrapped)
        with torch.no_grad():
            value = route_loss(wrapped.model, wrapped.inner, case.compute, wrapped.inner, batch, {})
            expected = case.compute(reference.model, batch, {})  # type: ignore[arg-type]
        out[f"no_grad-{wrapper}"] = {
            "value_diff": float((value - expected).abs()),
            "requires_grad": value.requires_grad,
            "clean": snapshot(wrapped) == before,
            "after": truth_step(wrapped, reference, 0),
        }
    wrapped, reference = build("fsdp2", {"groups": "layers"})
    wrapped.model.eval()
    reference.model.eval()
    modes_before = [m.training for m in wrapped.model.modules()]
    facts = truth_step(wrapped, reference, 0)
    out["eval-mode-fsdp2"] = {**facts, "modes_kept": [m.training for m in wrapped.model.modules()] == modes_before}

    from torch.nn.parallel import DistributedDataParallel as DDP

    model, ref_model = build_model(CONFIG), build_model(CONFIG)
    ddp = DDP(model)
    calls: list[int] = []
    ddp.register_forward_pre_hook(lambda module, args: calls.append(1))
    original = type(model).forward
    batches = [make_batch(case, CONFIG, r, 0, 0) for r in range(world)]

    def routing_forward(self: Any, input_ids: torch.Tensor) -> torch.Tensor:
        # a model whose own forward routes its loss (what a library-wrapped model might do)
        return route_loss(ddp, self, lambda: (original(self, input_ids) @ self.lm_head.weight.t()).sum())

    model.forward = routing_forward.__get__(model)  # type: ignore[method-assign]
    ddp(batches[rank]["input_ids"]).backward()
    del model.forward
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    differ, _ = _compare_across_ranks(grads)
    ref_loss = sum((original(ref_model, b["input_ids"]) @ ref_model.lm_head.weight.t()).sum() for b in batches)
    (ref_loss / world).backward()  # type: ignore[operator]
    ref_diff = max(float((grads[n] - p.grad).abs().max()) for n, p in ref_model.named_parameters())
    out["inside-own-forward-ddp"] = {"forward_calls": len(calls), "differ": differ, "max_ref_diff": ref_diff}
    return out


# --- property tests: random module trees --------------------------------------------------------------------


class Level(nn.Module):
    """One level of a random tree: a linear map, a buffer scaling it, and optionally a nested sub-level."""

    def __init__(self, width_in: int, width_out: int, depth: int, buffers: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(width_in, width_out)
        self.sub = Level(width_out, width_out, depth - 1, buffers) if depth > 1 else None
        if buffers:  # one persistent, one not: DDP broadcasts them, FSDP leaves them replicated
            self.register_buffer("scale", torch.linspace(0.5, 1.5, width_out))
            self.register_buffer("shift", torch.full((width_out,), 0.1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        if hasattr(self, "scale"):
            y = y * self.scale + self.shift
        return y + self.sub(y) if self.sub is not None else y


class RandomTree(nn.Module):
    """``embed`` -> ``blocks`` (a random tree of levels) -> hidden; the loss reads ``lm_head.weight`` directly.
    The names match the FSDP builders' layouts (``blocks`` and ``lm_head`` as their own groups/units)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        dim, widths = spec["dim"], list(spec["widths"])
        if spec["tied"]:  # lm_head.weight (dim x last) shares embed.weight (first x dim)
            widths[0] = widths[-1] = dim
        self.embed = nn.Linear(dim, widths[0])
        self.blocks = nn.ModuleList(
            Level(a, b, spec["depth"], spec["buffers"]) for a, b in zip(widths, widths[1:] + widths[-1:], strict=True)
        )
        self.lm_head = nn.Linear(widths[-1], dim, bias=False)
        if spec["tied"]:
            self.lm_head.weight = self.embed.weight
        if spec["unused"]:
            self.unused = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.embed(x))
        for block in self.blocks:
            x = block(x)
        return x


def _tree_batch(spec: dict[str, Any], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(spec["seed"] * 1009 + rank)
    rows = spec["sizes"][rank]
    x = torch.randn(rows, spec["dim"], generator=generator)
    return x, torch.randint(0, spec["dim"], (rows,), generator=generator)


def _tree_loss(model: Any, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(x) @ model.lm_head.weight.t()  # the fused-loss pattern: the weight, not the module
    return torch.nn.functional.cross_entropy(logits, labels)  # this rank's mean over its own rows


def tree_truth(spec: dict[str, Any]) -> dict[str, Any]:
    """Gradient truth for one random tree, wrapper, per-rank batch sizes and nesting of route_loss calls.

    Reference (DDP's and FSDP's promise): gradients are averaged over ranks, each rank's loss being the mean
    over its own rows, so a single process computes mean over ranks of per-rank mean losses, not the mean over
    all rows (the two differ when batch sizes differ)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.random.fork_rng():
        torch.manual_seed(spec["seed"])
        model = RandomTree(spec)
    reference = build_none(_clone_tree(model, spec), {})
    opts = dict(spec["opts"])
    if spec["wrapper"] in ("ddp", "replicate") and spec["unused"]:
        opts["find_unused_parameters"] = True
    if spec["wrapper"] == "fabric_ddp" and spec["unused"]:
        opts["strategy"] = "ddp_find_unused_parameters_true"
    wrapped = WRAPPERS[spec["wrapper"]].build(model, opts)
    inner: Any = wrapped.inner
    x, labels = _tree_batch(spec, rank)

    def nest(level: int) -> torch.Tensor:
        if level == 0:
            return _tree_loss(inner, x, labels)
        return route_loss(wrapped.model, inner, nest, level - 1, mode=spec["mode"]) * 1.0

    loss = route_loss(wrapped.model, inner, nest, spec["nest"], mode=spec["mode"])
    wrapped.backward(loss)
    grads = wrapped.full_grads()
    differ, _ = _compare_across_ranks(grads)
    ref_loss = sum(_tree_loss(reference.model, *_tree_batch(spec, r)) for r in range(world)) / world
    ref_loss.backward()  # type: ignore[union-attr]
    ref = reference.full_grads()
    target = detect(wrapped.model)
    forward_left = "forward" in target.adapter.redirect_target(target.wrapper).__dict__  # type: ignore[union-attr,arg-type]
    return {"differ": differ, "max_ref_diff": _max_diff(grads, ref), "params": len(grads), "forward_left": forward_left}


def _clone_tree(model: nn.Module, spec: dict[str, Any]) -> nn.Module:
    clone = RandomTree(spec)
    clone.load_state_dict(model.state_dict())
    return clone


def tree_truth_many(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [tree_truth(spec) for spec in specs]


# --- long run -----------------------------------------------------------------------------------------------


def long_run(wrapper: str, opts: dict[str, Any], steps: int, warmup: int) -> dict[str, Any]:
    """``steps`` routed steps on one model: the inner forward attribute identical after every step, hook
    counts constant, RSS growth after the warm-up."""
    import gc

    import psutil

    from wrapperroute._state import routing_state

    wrapped = WRAPPERS[wrapper].build(build_model(CONFIG), dict(opts))
    case = LOSSES["fused_ce"]
    found = detect(wrapped.model)
    target = found.adapter.redirect_target(found.wrapper)  # type: ignore[union-attr,arg-type]
    forward_before = target.__dict__.get("forward", None)
    hooks_before = hook_count(wrapped.model)
    batches = [make_batch(case, CONFIG, dist.get_rank(), step % 8, 0) for step in range(8)]
    process = psutil.Process()
    forward_changed = hooks_changed = 0
    rss_warm = 0
    for step in range(warmup + steps):
        if step == warmup:
            gc.collect()
            rss_warm = process.memory_info().rss
        loss = route_loss(wrapped.model, wrapped.inner, case.compute, wrapped.inner, batches[step % 8], {})
        wrapped.backward(loss)
        wrapped.step()
        forward_changed += target.__dict__.get("forward", None) is not forward_before
        hooks_changed += hook_count(wrapped.model) != hooks_before
    gc.collect()
    return {
        "steps": steps,
        "forward_changed": forward_changed,
        "hooks_changed": hooks_changed,
        "rss_growth_mib": (process.memory_info().rss - rss_warm) / 2**20,
        "redirections": routing_state().swaps,
        "plans": routing_state().plans,
    }


def released(wrapper: str, opts: dict[str, Any], routed: bool) -> dict[str, Any]:
    """Build a wrapped model, take ``steps`` routed steps (none when not ``routed``: the control), drop every
    reference the test holds, collect: whether the model and its wrapper are still alive, and the
    bookkeeping route_loss keeps."""
    import gc
    import weakref

    from wrapperroute._state import routing_state

    def run() -> tuple[weakref.ref[nn.Module], weakref.ref[nn.Module]]:
        wrapped = WRAPPERS[wrapper].build(build_model(CONFIG), dict(opts))
        case = LOSSES["fused_ce"]
        for step in range(2 if routed else 0):
            batch = make_batch(case, CONFIG, dist.get_rank(), step, 0)
            loss = route_loss(wrapped.model, wrapped.inner, case.compute, wrapped.inner, batch, {})
            wrapped.backward(loss)
            wrapped.step()
        return weakref.ref(wrapped.inner), weakref.ref(wrapped.model)

    gc.collect()
    plans, redirections = routing_state().plans, routing_state().swaps
    inner, model = run()
    gc.collect()
    return {
        "inner_alive": inner() is not None,
        "model_alive": model() is not None,
        "plans_added": routing_state().plans - plans,
        "redirections_added": routing_state().swaps - redirections,
    }


# --- threads ------------------------------------------------------------------------------------------------


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
        differ += _compare_across_ranks(grads)[0]
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
        "differ": _compare_across_ranks(grads)[0],
        "max_ref_diff": max(float((grads[n] - p.grad).abs().max()) for n, p in ref.named_parameters()),
        "eval_diff": float((results[1] - expected_eval).abs()) if isinstance(results[1], torch.Tensor) else None,
        "forward_left": "forward" in model.__dict__,
    }

    # one model, two grad-enabled forwards at once: a clear error for the second, the first completes
    for wrapper in ("ddp", "fsdp2"):
        out[f"two_grad_{wrapper}"] = _two_grad(wrapper)
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
        "differ": _compare_across_ranks(wrapped.full_grads())[0],
        "clean": not after["target_forward"] and not after["in_forward"],
    }


# --- edge cases found in review -----------------------------------------------------------------------------


class _Three(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.body, self.lm_head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.body(self.embed(x)))


def edge_cases() -> dict[str, Any]:
    """Each case as data (what the loss saw, what is left on the modules), for the test to judge.
    - agree=True with a one-shot iterator for gather= (FSDP2: embed and lm_head in their own groups);
    - two DDP wrappers over one module, a no-grad route through the second inside a loss routed through
      the first: both wrappers' forwards restored and usable;
    - an autocast instance forward (accelerate's AMP shape) removed for one step and the same one put back;
    - a plain model(x) in another thread that read the wrapper's forward while a loss ran, then ran it after
      that loss ended;
    - a model first routed through a torch.compile layer with no wrapper, then fully_shard-ed."""
    from torch.distributed.device_mesh import init_device_mesh

    from wrapperroute.check.wrap_fsdp import fsdp2_api

    fully_shard = fsdp2_api().fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = torch.randn(2, 4)

    def agree_gather_iterator() -> Any:
        sharded = _Three()
        for unit in (sharded.embed, sharded.lm_head, sharded):
            fully_shard(unit, mesh=mesh)
        return {
            agree: route_loss(
                sharded, None, lambda: type(sharded.embed.weight).__name__, gather=iter([sharded.embed]), agree=agree
            )
            for agree in (False, True)
        }

    def two_wrappers_left() -> Any:
        return _two_wrappers(x)

    def kept_autocast() -> Any:
        return _kept_autocast(x)

    def plain_thread_after_loss() -> Any:
        return _plain_thread(x)

    def sharded_after_first_call() -> Any:
        late = nn.Linear(4, 4)
        compiled = torch.compile(late, backend="eager")
        route_loss(compiled, late, lambda: None)  # planned: no wrapper yet
        fully_shard(late, mesh=mesh)
        return route_loss(compiled, late, lambda: late._get_fsdp_state()._training_state.name)  # type: ignore[operator]

    out: dict[str, Any] = {}
    for case in (agree_gather_iterator, two_wrappers_left, kept_autocast, plain_thread_after_loss,
                 sharded_after_first_call):  # fmt: skip
        try:
            out[case.__name__] = case()
        except Exception as error:  # each case reports on its own
            out[case.__name__] = f"{type(error).__name__}: {error}"
    return out


def _two_wrappers(x: torch.Tensor) -> list[bool]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    module = nn.Linear(4, 4)
    first, second = DDP(module), DDP(module)

    def outer() -> torch.Tensor:
        with torch.no_grad():
            route_loss(second, module, lambda: module(x).sum())
        return module(x).sum()

    route_loss(first, module, outer).backward()
    left = [w.__dict__.get("forward") for w in (first, second, module)]
    first(x).sum().backward()  # a plain step: usable
    route_loss(first, module, lambda: module(x).sum()).backward()
    return [f is not None for f in left]


def _kept_autocast(x: torch.Tensor) -> list[str]:
    import types

    from torch.nn.parallel import DistributedDataParallel as DDP

    amp = nn.Linear(4, 4)
    amp_ddp = DDP(amp)
    autocast_forward = types.MethodType(torch.autocast("cpu", dtype=torch.bfloat16)(type(amp).forward), amp)

    def dtype() -> str:  # a fused loss reads the weight itself: its matmul runs in the kept autocast, or not
        return str((x @ amp.weight.t()).dtype)

    seen = []
    for present in (True, False, True):
        if present:
            amp.forward = autocast_forward  # type: ignore[method-assign]
        else:
            del amp.forward
        with torch.no_grad():
            seen.append(route_loss(amp_ddp, amp, dtype))
    return seen


def _plain_thread(x: torch.Tensor) -> dict[str, Any]:
    import threading

    from torch.nn.parallel import DistributedDataParallel as DDP

    plain = nn.Linear(4, 4)
    plain_ddp = DDP(plain, broadcast_buffers=False)
    in_loss, resolved, loss_done = threading.Event(), threading.Event(), threading.Event()

    def hold(_module: nn.Module, _args: Any) -> None:
        if threading.current_thread().name == "plain":
            resolved.set()  # _call_impl has read self.forward (the passthrough) already
            loss_done.wait(10)

    handle = plain_ddp.register_forward_pre_hook(hold)
    result: dict[str, Any] = {}

    def routed() -> None:
        def fn() -> torch.Tensor:
            in_loss.set()
            resolved.wait(10)
            return plain(x).sum()

        with torch.no_grad():
            route_loss(plain_ddp, plain, fn)
        loss_done.set()

    def plain_call() -> None:
        in_loss.wait(10)
        try:
            with torch.no_grad():
                result["shape"] = list(plain_ddp(x).shape)
        except Exception as error:  # the thing under test
            result["error"] = f"{type(error).__name__}: {error}"

    threads = [threading.Thread(target=routed), threading.Thread(target=plain_call, name="plain")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    handle.remove()
    return result
