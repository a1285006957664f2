"""Rank-side benchmark bodies. Every figure is a ratio of two paths timed in the same process, interleaved
(the order alternates every repetition), so the machine's noise hits both alike."""

from __future__ import annotations

import ctypes
import functools
import gc
import resource
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from wrapperroute import route_loss
from wrapperroute.check.losses import LIGER_CONFIG, LOSSES, make_batch
from wrapperroute.check.models import TinyCausalLM, TinyConfig, build_model

SIZES = {
    "tiny": TinyConfig(),  # ~38k parameters
    "10M": TinyConfig(vocab=8192, hidden=512, layers=4, seq=32),  # ~9.4M parameters
}


def fused_ce(model: TinyCausalLM, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(ids) @ model.lm_head.weight.t()
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class NativeLoss(nn.Module):
    """The same loss computed inside the model's own forward: the native path routing must match."""

    def __init__(self, lm: TinyCausalLM) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return fused_ce(self.lm, ids, labels)


def _sync_time(step: Callable[[], Any]) -> float:
    dist.barrier()
    start = time.perf_counter()
    step()
    dist.barrier()
    return time.perf_counter() - start


def _paired(a: Callable[[], Any], b: Callable[[], Any], reps: int, warmup: int = 3) -> dict[str, Any]:
    for _ in range(warmup):
        a()
        b()
    times_a, times_b = [], []
    for rep in range(reps):
        order = (a, b) if rep % 2 == 0 else (b, a)
        first = _sync_time(order[0])
        second = _sync_time(order[1])
        ta, tb = (first, second) if rep % 2 == 0 else (second, first)
        times_a.append(ta)
        times_b.append(tb)
    ratios = sorted(x / y for x, y in zip(times_a, times_b, strict=True))
    q = lambda values, f: sorted(values)[min(len(values) - 1, int(f * len(values)))]  # noqa: E731
    return {
        "median_a_ms": q(times_a, 0.5) * 1e3,
        "median_b_ms": q(times_b, 0.5) * 1e3,
        "ratio": q(ratios, 0.5),
        "ratio_p10": q(ratios, 0.1),
        "ratio_p90": q(ratios, 0.9),
        "reps": reps,
    }


def _repeated(call: Callable[[], Any], times: int) -> Callable[[], None]:
    """``call`` run ``times`` times: one timed unit."""

    def run() -> None:
        for _ in range(times):
            call()

    return run


def params_of(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _steps_per_rep(model: nn.Module) -> int:
    # A tiny step (~4 ms) is at the noise floor of two shared cores: time 20 of them per repetition.
    return 20 if params_of(model) < 1_000_000 else 1


def ddp_step_ratio(size: str, reps: int) -> dict[str, Any]:
    """Routed DDP step / native DDP step (loss inside the model's forward), forward+backward+SGD."""
    config = SIZES[size]
    generator = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, config.vocab, (4, config.seq), generator=generator)
    labels = torch.roll(ids, -1, 1)
    lm_native, lm_routed = build_model(config), build_model(config)
    native = DDP(NativeLoss(lm_native))
    routed = DDP(lm_routed)
    opt_native = torch.optim.SGD(native.parameters(), lr=1e-3)
    opt_routed = torch.optim.SGD(routed.parameters(), lr=1e-3)

    def native_step() -> None:
        native(ids, labels).backward()
        opt_native.step()
        opt_native.zero_grad(set_to_none=True)

    def routed_step() -> None:
        route_loss(routed, lm_routed, fused_ce, lm_routed, ids, labels).backward()
        opt_routed.step()
        opt_routed.zero_grad(set_to_none=True)

    per_rep = _steps_per_rep(lm_routed)
    timed = _paired(_repeated(routed_step, per_rep), _repeated(native_step, per_rep), reps)
    return {"params": params_of(lm_routed), "steps_per_rep": per_rep, **timed}


def guard_overhead(size: str, reps: int) -> dict[str, Any]:
    """A routed DDP step inside ``wrapperroute.guard(model)`` / the same step unguarded (two models, timed side by
    side; the guard is entered once around training, as a user would)."""
    from wrapperroute import guard

    config = SIZES[size]
    ids = torch.randint(0, config.vocab, (4, config.seq), generator=torch.Generator().manual_seed(dist.get_rank()))
    labels = torch.roll(ids, -1, 1)
    models = [build_model(config), build_model(config)]
    ddps = [DDP(m) for m in models]
    per_rep = _steps_per_rep(models[0])

    def step(i: int) -> Callable[[], None]:
        def run() -> None:
            route_loss(ddps[i], models[i], fused_ce, models[i], ids, labels).backward()
            ddps[i].zero_grad(set_to_none=True)

        return _repeated(run, per_rep)

    with guard(ddps[0]):
        timed = _paired(step(0), step(1), reps)
    return {"params": params_of(models[0]), "steps_per_rep": per_rep, **timed}


def fallback_ratio(reps: int) -> dict[str, Any]:
    """Liger DPO routed isolated (the fallback) / routed plainly (no fallback needed once compiled), and the
    fallback / the crash-free alternative a user could pick instead (``compiled=False``)."""
    from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

    case, config = LOSSES["liger_dpo"], LIGER_CONFIG
    model = build_model(config)
    ddp = DDP(model)
    extras = case.extras(config)
    eager_extras = {**case.extras(config), "dpo": LigerFusedLinearDPOLoss(beta=0.1, compiled=False)}
    batch = make_batch(case, config, dist.get_rank(), 0, 0)
    case.compute(build_model(config), batch, extras).backward()  # compile once, outside DDP: no crash later

    def step(mode: str, ex: dict[str, Any]) -> Callable[[], None]:
        def run() -> None:
            route_loss(ddp, model, case.compute, model, batch, ex, mode=mode).backward()  # type: ignore[arg-type]
            model.zero_grad(set_to_none=True)

        return run

    return {
        "isolate_vs_redirect": _paired(step("isolate", extras), step("redirect", extras), reps),
        "isolate_vs_uncompiled": _paired(step("isolate", extras), step("redirect", eager_extras), reps),
    }


CALLS = 2000


class _BareToken:
    __slots__ = ("args", "fn")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args


def _bare_dispatch(token: _BareToken) -> Any:
    return token.fn(*token.args)


def bare_swap(wrapper: nn.Module, target: nn.Module, fn: Callable[..., Any], *args: Any) -> Any:
    """Our mechanism with none of its checks (no plan, lock, refcount, passthrough, re-entry, in-forward or
    process-group check, token check): a measuring stick for the per-call decomposition, not a usable router
    (two threads, a loss calling the model, or a wrapper that drops the token all break it)."""
    target.__dict__["forward"] = _bare_dispatch
    try:
        return wrapper(_BareToken(fn, args))
    finally:
        target.__dict__.pop("forward", None)


def call_overhead(reps: int) -> dict[str, Any]:
    """Per-call cost of routing a trivial loss through DDP (no grad, so only the routing and DDP's forward
    bookkeeping are timed): ours vs TRL's ``_ForwardRedirection`` (Lightning's), and vs parameter count."""
    out: dict[str, Any] = {}
    x = torch.ones(())

    def trivial(t: torch.Tensor) -> torch.Tensor:
        return t

    try:
        from trl.models.utils import _ForwardRedirection

        theirs: Any = _ForwardRedirection()
    except ImportError:
        theirs = None
    for label, config in (
        ("1e5", TinyConfig(vocab=1024, hidden=48, layers=1)),
        ("1e6", TinyConfig(vocab=4096, hidden=128, layers=2)),
        ("1e7", TinyConfig(vocab=8192, hidden=512, layers=4)),
    ):
        # Separate models: TRL's redirection leaves a ``forward`` attribute on the module it touched.
        model, their_model = build_model(config), build_model(config)
        ddp, their_ddp = DDP(model), DDP(their_model)
        ours = _repeated(functools.partial(route_loss, ddp, model, trivial, x), CALLS)
        trl = _repeated(functools.partial(theirs, their_ddp, their_model, trivial, x), CALLS) if theirs else None
        with torch.no_grad():
            row: dict[str, Any] = {"params": sum(p.numel() for p in model.parameters())}
            if theirs is not None:
                paired = _paired(ours, trl, reps, warmup=1)
                row["ours_us"] = paired["median_a_ms"] * 1e3 / CALLS
                row["trl_us"] = paired["median_b_ms"] * 1e3 / CALLS
                row["ours_over_trl"] = paired["ratio"]
                row["ratio_p10"], row["ratio_p90"] = paired["ratio_p10"], paired["ratio_p90"]
                if label == "1e6":  # where the gap comes from: the bare swap against TRL's, then ours against it
                    bare_model = build_model(config)
                    bare = _repeated(functools.partial(bare_swap, DDP(bare_model), bare_model, trivial, x), CALLS)
                    paired = _paired(bare, trl, reps, warmup=1)
                    row["bare_us"] = paired["median_a_ms"] * 1e3 / CALLS
                    row["bare_over_trl"] = paired["ratio"]
                    row["bare_p10"], row["bare_p90"] = paired["ratio_p10"], paired["ratio_p90"]
            else:
                row["ours_us"] = min(_sync_time(ours) for _ in range(reps)) * 1e6 / CALLS
        out[label] = row
    return out


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
    )]  # fmt: skip


@functools.cache
def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    try:
        info = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    info.restype = _MallInfo2
    return info  # type: ignore[no-any-return]


def _malloc_in_use() -> int:
    """Bytes glibc's malloc has handed out right now (torch's CPU tensors come from it)."""
    info = _mallinfo2()
    assert info is not None, "glibc only"
    current = info()
    return int(current.uordblks + current.hblkhd)


def allocated_in_step(size: str, reps: int) -> dict[str, Any]:
    """Bytes allocated and still held after the forward (activations, the loss) and after the backward
    (plus gradients), routed vs native, same model size, same process, alternating: unlike peak RSS, exact to
    the byte. Routing that copied its payload would show up here."""
    if _mallinfo2() is None:
        return {"error": "mallinfo2 is glibc-only"}
    config = SIZES[size]
    ids = torch.randint(0, config.vocab, (4, config.seq))
    labels = torch.roll(ids, -1, 1)
    lm_native, lm_routed = build_model(config), build_model(config)
    native, routed = DDP(NativeLoss(lm_native)), DDP(lm_routed)
    paths: dict[str, tuple[nn.Module, Callable[[], torch.Tensor]]] = {
        "native": (native, lambda: native(ids, labels)),
        "routed": (routed, lambda: route_loss(routed, lm_routed, fused_ce, lm_routed, ids, labels)),
    }
    held: dict[str, dict[str, list[int]]] = {name: {"forward": [], "backward": []} for name in paths}
    for rep in range(reps + 2):  # two warm-up steps per path: lazy buffers, DDP's bucket rebuild
        for name in paths if rep % 2 == 0 else reversed(paths):
            model, forward = paths[name]
            gc.collect()
            base = _malloc_in_use()
            loss = forward()
            after_forward = _malloc_in_use() - base
            loss.backward()
            del loss
            after_backward = _malloc_in_use() - base
            model.zero_grad(set_to_none=True)
            if rep >= 2:
                held[name]["forward"].append(after_forward)
                held[name]["backward"].append(after_backward)
    median = {name: {k: sorted(v)[len(v) // 2] for k, v in phases.items()} for name, phases in held.items()}
    return {
        "forward_native_mib": median["native"]["forward"] / 2**20,
        "forward_routed_minus_native_kib": (median["routed"]["forward"] - median["native"]["forward"]) / 2**10,
        "backward_routed_minus_native_kib": (median["routed"]["backward"] - median["native"]["backward"]) / 2**10,
    }


def peak_rss(path: str, size: str, steps: int) -> dict[str, Any]:
    """Peak RSS of this (fresh) rank after ``steps`` steps of one path: call in a fresh pool per path."""
    config = SIZES[size]
    ids = torch.randint(0, config.vocab, (4, config.seq))
    labels = torch.roll(ids, -1, 1)
    lm = build_model(config)
    if path == "native":
        model: nn.Module = DDP(NativeLoss(lm))
        step: Callable[[], torch.Tensor] = lambda: model(ids, labels)  # noqa: E731
    else:
        model = DDP(lm)
        step = lambda: route_loss(model, lm, fused_ce, lm, ids, labels)  # noqa: E731
    for _ in range(steps):
        step().backward()
        model.zero_grad(set_to_none=True)
    return {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _routed_versus(
    wrapper: str, opts: dict[str, Any], alternative: Callable[[Any, Any], None], reps: int
) -> dict[str, Any]:
    """Routed step vs ``alternative(wrapped, batch)`` on the 10M model, timed side by side, each with its
    max |grad - single-process reference| (or the error it raised: then it is not timed)."""
    from wrapperroute.check.wrappers import WRAPPERS

    config = SIZES["10M"]
    case = LOSSES["fused_ce"]
    batches = [make_batch(case, config, r, 0, 0, rows=4) for r in range(dist.get_world_size())]
    batch = batches[dist.get_rank()]
    reference = build_model(config)
    case.compute(reference, case.concat(batches), {}).backward()
    ref = {n: p.grad for n, p in reference.named_parameters()}
    routed = WRAPPERS[wrapper].build(build_model(config), opts)
    other = WRAPPERS[wrapper].build(build_model(config), opts)

    def routed_step() -> None:
        routed.backward(route_loss(routed.model, routed.inner, case.compute, routed.inner, batch, {}))

    def other_step() -> None:
        alternative(other, batch)

    def error(wrapped: Any, step: Callable[[], None]) -> float | str:
        try:
            step()
            grads = wrapped.full_grads()
        except Exception as failure:  # the alternative may not run at all: that is its correctness
            return f"{type(failure).__name__}: {str(failure)[:80]}"
        finally:
            wrapped.model.zero_grad()
        return max(float((grads[n] - ref[n]).abs().max()) for n in ref)

    result: dict[str, Any] = {"routed_max_ref_diff": error(routed, routed_step)}
    result["alternative_max_ref_diff"] = error(other, other_step)
    if not isinstance(result["alternative_max_ref_diff"], str):
        result.update(_paired(routed_step, other_step, reps))
    return result


def _full_tensor_loss(wrapped: Any, batch: dict[str, torch.Tensor]) -> None:
    """TRL's choice under FSDP2: the root forward runs, lm_head's weight is gathered by a differentiable
    ``full_tensor()`` (its own group's forward never runs)."""
    from wrapperroute.check.wrap_fsdp import fsdp2_api

    DTensor = fsdp2_api().DTensor

    hidden = wrapped.model(batch["input_ids"])
    weight = wrapped.model.lm_head.weight
    weight = weight.full_tensor() if isinstance(weight, DTensor) else weight
    logits = hidden @ weight.t()
    F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).backward()


def _gathered_loss(wrapped: Any, batch: dict[str, torch.Tensor]) -> None:
    """ZeRO-3 without the engine's forward: every parameter gathered around a loss on the unwrapped module."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(wrapped.inner.parameters())):
        wrapped.backward(LOSSES["fused_ce"].compute(wrapped.inner, batch, {}))


def fsdp2_alternatives(reps: int) -> dict[str, Any]:
    """FSDP2, lm_head its own group: routed vs the ``full_tensor()`` gather."""
    return _routed_versus("fsdp2", {"groups": "layers"}, _full_tensor_loss, reps)


def zero3_alternatives(reps: int) -> dict[str, Any]:
    """ZeRO-3: routed vs ``GatheredParameters`` over every parameter."""
    return _routed_versus("zero3", {}, _gathered_loss, reps)
