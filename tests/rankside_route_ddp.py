"""Rank bodies for tests/test_route_ddp.py (module level: the pool pickles them by reference). Each asserts its
facts where it finds them."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from wrapperroute import route_loss
from wrapperroute.check.cell import REFERENCE_TOLERANCE, Cell, CellResult, differing_across_ranks, run_cell
from wrapperroute.check.losses import fused_cross_entropy
from wrapperroute.check.models import TinyCausalLM, TinyConfig, build_model

CONFIG = TinyConfig()


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CONFIG.vocab, (2, CONFIG.seq), generator=generator)
    return ids, torch.roll(ids, -1, 1)


def _grads(model: TinyCausalLM) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _exact(result: CellResult, what: str) -> None:
    assert result.error is None, f"{what}: {result.error}"
    assert result.differ == 0, f"{what}: {result.differ} of {result.params} parameters' gradients differ across ranks"
    assert result.max_ref_diff <= REFERENCE_TOLERANCE, f"{what}: gradients {result.max_ref_diff:.3g} from one process's"


def no_sync_skips_allreduce() -> None:
    """Inside no_sync a routed backward must not all-reduce; at the sync step it must."""
    model = build_model(CONFIG)
    ddp = DDP(model)
    ids, labels = _batch(dist.get_rank())
    with ddp.no_sync():
        route_loss(ddp, model, fused_cross_entropy, model, ids, labels).backward()
    params = len(_grads(model))
    differ_inside, _ = differing_across_ranks(_grads(model))
    assert differ_inside == params, f"inside no_sync {params - differ_inside} of {params} gradients were all-reduced"
    route_loss(ddp, model, fused_cross_entropy, model, ids, labels).backward()
    differ_after, _ = differing_across_ranks(_grads(model))
    assert differ_after == 0, f"after the sync step {differ_after} of {params} gradients differ across ranks"


def fn_raises_then_exact() -> None:
    """An exception inside fn: forward restored, no attribute left, the next routed step exact."""
    model = build_model(CONFIG)
    ddp = DDP(model)
    before = dict(model.__dict__)
    try:
        route_loss(ddp, model, lambda: (_ for _ in ()).throw(ValueError("boom inside the loss")))
        raised = None
    except ValueError as error:
        raised = str(error)
    assert raised == "boom inside the loss", f"fn's ValueError became {raised}"
    left = set(model.__dict__) ^ set(before)
    assert "forward" not in model.__dict__ and not left, f"the inner module was not left as it was: {left}"
    del ddp, model
    _exact(run_cell(Cell(loss="fused_ce", steps=2)), "the next routed steps")


def nested_runs_once() -> None:
    """route_loss inside fn, on the same wrapper, runs directly: the DDP forward is entered once."""
    model = build_model(CONFIG)
    ddp = DDP(model)
    calls: list[int] = []
    ddp.register_forward_pre_hook(lambda module, args: calls.append(1))
    ids, labels = _batch(dist.get_rank())

    def outer() -> torch.Tensor:
        return route_loss(ddp, model, fused_cross_entropy, model, ids, labels) * 1.0

    route_loss(ddp, model, outer).backward()
    differ, _ = differing_across_ranks(_grads(model))
    assert len(calls) == 1, f"the DDP forward was entered {len(calls)} times"
    assert differ == 0, f"{differ} parameters' gradients differ across ranks"
    assert "forward" not in model.__dict__, "an instance forward was left on the model"


@dataclasses.dataclass
class LossOutput:
    loss: torch.Tensor
    logits_mean: torch.Tensor
    note: str


def pytree_outputs(find_unused: bool) -> None:
    """fn may return a tuple, dict, dataclass or ModelOutput; DDP's output walk keeps the structure, and the loss
    in it is in sync."""
    model = build_model(CONFIG)
    ddp = DDP(model, find_unused_parameters=find_unused)
    ids, labels = _batch(dist.get_rank())

    def as_tuple() -> tuple[torch.Tensor, int]:
        return fused_cross_entropy(model, ids, labels), 7

    def as_dict() -> dict[str, Any]:
        return {"loss": fused_cross_entropy(model, ids, labels), "tag": "x"}

    def as_dataclass() -> LossOutput:
        loss = fused_cross_entropy(model, ids, labels)
        return LossOutput(loss, loss.detach() * 0, "dc")

    for name, fn, kind in (("tuple", as_tuple, "tuple"), ("dict", as_dict, "dict"),
                           ("dataclass", as_dataclass, "LossOutput")):  # fmt: skip
        out = route_loss(ddp, model, fn)
        loss = out[0] if name == "tuple" else out["loss"] if name == "dict" else out.loss
        loss.backward()
        assert type(out).__name__ == kind, f"fn returned a {kind}, route_loss a {type(out).__name__}"
        differ, _ = differing_across_ranks(_grads(model))
        assert differ == 0, f"the loss in a {kind}: {differ} parameters' gradients differ across ranks"
        model.zero_grad(set_to_none=True)
    try:
        from transformers.modeling_outputs import CausalLMOutput

        def as_model_output() -> CausalLMOutput:
            return CausalLMOutput(loss=fused_cross_entropy(model, ids, labels))

        out = route_loss(ddp, model, as_model_output)
        out.loss.backward()
        differ = differing_across_ranks(_grads(model))[0]
        assert differ == 0, f"the loss in a ModelOutput: {differ} parameters' gradients differ across ranks"
    except ImportError:
        pass


def threads_keep_their_payloads() -> None:
    """Two threads route through one DDP model at once (no grad, so the reducer stays out of it): each gets
    its own result and the forward is restored once both are done."""
    model = build_model(CONFIG)
    ddp = DDP(model)
    barrier = threading.Barrier(2, timeout=30)
    got: dict[str, Any] = {}

    def worker(tag: str) -> None:
        def fn() -> str:
            barrier.wait()  # both calls are inside the wrapper's forward at the same time
            return tag

        with torch.no_grad():
            got[tag] = route_loss(ddp, model, fn)

    threads = [threading.Thread(target=worker, args=(t,)) for t in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    # DDP's forward marker may now be stale (overlapping forwards in two threads): the next route clears it.
    with torch.no_grad():
        route_loss(ddp, model, lambda: None)
    assert got == {"a": "a", "b": "b"}, f"each thread's result, by its tag: {got}"
    assert "forward" not in model.__dict__, "an instance forward was left on the model"
    assert not _marker_left(), "the next routed call left DDP's forward marker set"


def _marker_left() -> bool:
    return DDP._active_ddp_module is not None


class _Held(torch.nn.Module):
    """Holds its forward open until told: lets a test overlap two DDP forwards in two threads exactly."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.entered, self.release = threading.Event(), threading.Event()

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        self.release.wait(30)
        return fused_cross_entropy(self.inner, ids, labels)


def stale_ddp_marker() -> None:
    """DDP saves and restores its class-wide forward marker per call, so forwards overlapping in two threads
    (A enters, B enters, A exits, B exits) leave it pointing at A after both ended. A stale marker must neither
    make route_loss skip the forward (a silent desync: it would look like a call from inside A's forward) nor
    stay set (Dynamo would apply DDP's graph optimizer to everything compiled later)."""
    held = DDP(_Held(build_model(CONFIG, seed=1)))
    ids, labels = _batch(dist.get_rank())
    thread = threading.Thread(target=lambda: held(ids, labels).backward())
    thread.start()
    held.module.entered.wait(30)

    class LetsAFinish(torch.nn.Linear):  # B: enters its forward while A is inside A's, returns after A ended
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            held.module.release.set()
            thread.join(60)
            return super().forward(x).sum()

    DDP(LetsAFinish(1, 1))(torch.ones(1, 1)).backward()
    stale = DDP._active_ddp_module is held
    if DDP._active_ddp_module is None and not stale:
        # torch < 2.5 resets the marker to None instead of restoring it, so threads cannot leave it stale there;
        # set it as newer torch leaves it, so what route_loss does with a stale marker is checked on every torch.
        DDP._active_ddp_module = held
        stale = True
    held.zero_grad()
    model: TinyCausalLM = held.module.inner  # type: ignore[assignment]
    entered = []

    def fn() -> torch.Tensor:
        entered.append("forward" in held.module.__dict__)  # our dispatch is installed only inside DDP's forward
        return fused_cross_entropy(model, ids, labels)

    route_loss(held, held.module, fn).backward()
    differ, _ = differing_across_ranks(_grads(model))
    assert stale, "the scenario must leave DDP's marker stale, or it proves nothing"
    assert entered == [True], f"the loss ran inside DDP's forward, per call: {entered}"
    assert differ == 0, f"{differ} parameters' gradients differ across ranks"
    assert not _marker_left(), "the routed call left DDP's stale forward marker set"


def compiled_layers() -> None:
    """compile(DDP(model)) and DDP(compile(model)) both route through DDP's forward; the OptimizedModule's
    own instance forward (which DDP calls in the second layout) is swapped and then put back."""
    for layout in ("compile_outside", "compile_inside"):
        model = build_model(CONFIG)
        wrapped = torch.compile(DDP(model)) if layout == "compile_outside" else DDP(torch.compile(model))
        target = wrapped.module if isinstance(wrapped, DDP) else wrapped._orig_mod.module
        forward_before = target.__dict__.get("forward")
        ids, labels = _batch(dist.get_rank())
        route_loss(wrapped, model, fused_cross_entropy, model, ids, labels).backward()
        differ, _ = differing_across_ranks(_grads(model))
        assert differ == 0, f"{layout}: {differ} parameters' gradients differ across ranks"
        forward = target.__dict__.get("forward")
        assert forward is forward_before, f"{layout}: {type(target).__name__}.forward {forward_before}, now {forward}"


def compiled_step_routes() -> None:
    """A compiled training step (``torch.compile`` of a function that calls ``route_loss``): Dynamo meets
    route_loss, which runs eagerly between its graphs; the gradients are those of the same step uncompiled,
    identical across ranks."""
    got = {}
    for compiled in (False, True):
        model = build_model(CONFIG)
        ddp = DDP(model)
        ids, labels = _batch(dist.get_rank())

        def step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return route_loss(ddp, model, fused_cross_entropy, model, ids, labels) * 2.0  # noqa: B023

        (torch.compile(step, backend="eager") if compiled else step)(ids, labels).backward()
        got[compiled] = _grads(model)
        differ, _ = differing_across_ranks(got[compiled])
        assert differ == 0, f"compiled={compiled}: {differ} parameters' gradients differ across ranks"
    worst = max(float((got[True][name] - got[False][name]).abs().max()) for name in got[False])
    assert worst == 0.0, f"the compiled step's gradients are {worst} off the eager step's"


def saved_tensor_hooks_after(mode: str, expect: str) -> None:
    """A failed compile inside a torch.func transform must not leave saved-tensor hooks disabled (they are
    what gradient checkpointing runs on), whether the error is re-raised (``expect="crash"``) or the fallback
    engages (``expect="fallback"``)."""
    result = run_cell(Cell(loss="liger_dpo", mode=mode, fresh_compile=True))  # type: ignore[arg-type]
    assert torch._C._autograd._saved_tensors_hooks_is_enabled(), f"mode={mode}: saved-tensor hooks left disabled"
    if expect == "fallback":
        assert result.fell_back and result.error is None, f"mode={mode}: fell back {result.fell_back}, {result.error}"
    else:
        assert result.error is not None and "TensorWrapper" in result.error, f"mode={mode}: {result.error}"


class _ReplacesInputs(DDP):
    """A wrapper that does not pass its inputs through unchanged: it copies them, or swallows them."""

    swallow = False

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.swallow:  # returns without calling the inner module at all
            return torch.zeros(())
        return super().forward(*[object() for _ in inputs], **kwargs)


def token_replaced_by_wrapper() -> None:
    """A wrapper that replaces our call token: the loss never ran inside its forward. If the wrapper then
    fails, its error says the loss did not run; if it returns, route_loss raises instead of returning whatever
    the wrapper made. The forward is restored either way."""

    model = build_model(CONFIG)
    ddp = _ReplacesInputs(model)
    ids, labels = _batch(dist.get_rank())
    for swallow in (False, True):
        ddp.swallow = swallow
        kind, message = "returned", ""
        try:
            with torch.no_grad():
                route_loss(ddp, model, fused_cross_entropy, model, ids, labels)
        except Exception as error:
            note = " ".join(getattr(error, "__notes__", []))
            kind, message = type(error).__name__, f"{error} {note}"
        if swallow:  # the wrapper returned without the loss: route_loss raises instead of returning its output
            assert kind == "RouteStateError" and "without running the loss" in message, f"{kind}: {message}"
        else:  # the wrapper's own error, annotated
            assert kind != "returned" and "before the loss ran" in message, f"{kind}: {message}"
    assert "forward" not in model.__dict__ and "forward" not in ddp.__dict__, "an instance forward was left"
