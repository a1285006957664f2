"""Rank bodies for tests/test_sequences.py: a training sequence played on a routed model and on its native twin.

The twins start from the same weights under the same wrapper. The native twin computes its loss through
``model(...)``: its forward calls the head module. The routed twin calls ``route_loss`` with the fused pattern:
the backbone, then the head's weight read directly. Both take the same events in the same order; after each,
every parameter of the two is compared, and ``check_grad_sync`` is held against the truth measured here, by an
all-gather of every local gradient.

A batch that raises (a plain forward, or the loss) is the batch a loop skips: the routed twin plays it and
skips it, calling nothing (routing repairs what the failed forward left, keeping the step's other gradients), and
the native twin never sees it, the truth of a run without that batch. (FSDP2's documented recovery,
``reset_iter_state()``, drops every gradient the step had accumulated since torch 2.15, so a native twin
following it is no truth.) FSDP1 documents no recovery, and natively after a forward that raised it refuses
``no_sync`` and reuses stale parameters: its sequences hold no raising event (routing through FSDP1 after one is
held against one process instead: tests/test_run_states.py).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from wrapperroute import check_grad_sync, detect, route_loss
from wrapperroute.check.models import TinyCausalLM, TinyConfig
from wrapperroute.check.wrappers import WRAPPERS, Wrapped

CONFIG = TinyConfig(vocab=64, hidden=16, layers=2, seq=6)
LR, MOMENTUM = 0.1, 0.9
DEEPSPEED = ("zero2", "zero3")
SHARDED = ("fsdp1", "fsdp2", "zero2", "zero3")  # local gradients differ across ranks by design
OPTIONS = {"fsdp2": {"groups": "layers"}, "zero3": {"zero": {"stage3_param_persistence_threshold": 0}}}


class SequenceLM(TinyCausalLM):
    """The tiny LM whose forward can compute the loss itself (the native path), or fail after the backbone."""

    def forward(  # type: ignore[override]
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, fail: bool = False
    ) -> torch.Tensor:
        hidden = super().forward(input_ids)
        if fail:
            raise ValueError("the loss failed")
        if labels is None:
            return hidden
        return F.cross_entropy(self.lm_head(hidden).flatten(0, 1), labels.flatten())


def fused_loss(inner: nn.Module, ids: torch.Tensor, labels: torch.Tensor, fail: bool = False) -> torch.Tensor:
    """The routed twin's loss: the head's weight read directly, the very arithmetic of ``self.lm_head(hidden)``."""
    hidden = inner(ids)
    if fail:
        raise ValueError("the loss failed")
    head: Any = inner.lm_head
    return F.cross_entropy(F.linear(hidden, head.weight).flatten(0, 1), labels.flatten())


class Twin:
    """One model of the pair, and how it plays each event."""

    def __init__(self, wrapper: str, routed: bool, folder: str) -> None:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = SequenceLM(CONFIG)
        self.wrapper, self.routed, self.folder = wrapper, routed, folder
        self.wrapped: Wrapped = WRAPPERS[wrapper].build(model, dict(OPTIONS.get(wrapper, {})))
        self.engine: Any = self.wrapped.model if wrapper in DEEPSPEED else None
        found = detect(self.wrapped.model)
        # what a state dict is taken from: the wrapper itself (Fabric's module holds DDP inside)
        self.holder: nn.Module = found.wrapper if found.wrapper is not None else self.wrapped.model
        self.optimizer = None if self.engine else torch.optim.SGD(self.holder.parameters(), lr=LR, momentum=MOMENTUM)
        # the parameters training holds, by name: after a forward that raised, FSDP2's module attributes are the
        # gathered copies that forward left, not these
        self.held = list(zip([n for n, _ in self.wrapped.inner.named_parameters()],
                             [p for group in self.optimizer.param_groups for p in group["params"]]
                             if self.optimizer else [], strict=False))  # fmt: skip
        self.saved: Any = None

    def loss(self, ids: torch.Tensor, labels: torch.Tensor, fail: bool = False) -> torch.Tensor:
        if self.routed:
            return route_loss(self.wrapped.model, self.wrapped.inner, fused_loss, self.wrapped.inner, ids, labels, fail)
        loss: torch.Tensor = self.wrapped.model(ids, labels, fail)
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        self.wrapped.backward(loss)
        if self.engine is not None:
            self.engine.step()  # DeepSpeed's unit of training: backward, then its step (update and zero_grad)

    def play(self, event: str, ids: torch.Tensor, labels: torch.Tensor) -> None:
        if event == "train":
            self.backward(self.loss(ids, labels))
        elif event == "accumulate":
            with self.wrapped.no_sync():
                self.backward(self.loss(ids, labels))
        elif event == "step":
            assert self.optimizer is not None, f"{self.wrapper} steps in its engine: no 'step' event for it"
            self.optimizer.step()
        elif event == "zero_grad":
            assert self.optimizer is not None, f"{self.wrapper} zeroes in its engine: no 'zero_grad' event for it"
            self.optimizer.zero_grad(set_to_none=True)
        elif event == "plain_forward":
            self.wrapped.model(ids)  # a forward whose output is used for nothing (a probe, a metric)
        elif event == "plain_forward_raises":
            with contextlib.suppress(IndexError):  # a token id out of range: the batch the loop skips, nothing else
                self.wrapped.model(torch.full_like(ids, CONFIG.vocab + 3))
        elif event == "loss_raises":
            with contextlib.suppress(ValueError):
                self.loss(ids, labels, fail=True)
        elif event == "eval":
            with torch.no_grad():
                self.loss(ids, labels)
        elif event == "nan_skip":  # every label ignored: the mean over no token is NaN, and the loop skips it
            loss = self.loss(ids, torch.full_like(labels, -100))
            assert math.isnan(float(loss.detach())), float(loss)
        elif event == "save":
            self.save()
        elif event == "load":
            self.load()
        else:
            raise ValueError(f"unknown event {event!r}")

    def save(self) -> None:
        if self.engine is not None:
            self.engine.save_checkpoint(self.folder, tag="twin")
            self.saved = True
            return
        from torch.distributed.checkpoint.state_dict import get_state_dict

        assert self.optimizer is not None, f"{self.wrapper} has no optimizer of its own to save"
        self.saved = copy.deepcopy(get_state_dict(self.holder, self.optimizer))

    def load(self) -> None:
        if self.saved is None:
            return
        if self.engine is not None:
            self.engine.load_checkpoint(self.folder, tag="twin")
            return
        from torch.distributed.checkpoint.state_dict import set_state_dict

        model_state, optimizer_state = copy.deepcopy(self.saved)
        set_state_dict(self.holder, self.optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)

    def full_params(self) -> dict[str, torch.Tensor]:
        """Every parameter whole (collectives for the sharded wrappers: every rank, same order)."""
        inner = self.wrapped.inner
        if self.wrapper == "zero3":
            from deepspeed.utils import safe_get_full_fp32_param

            return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in inner.named_parameters()}
        if self.wrapper == "fsdp1":
            from wrapperroute.check.wrap_fsdp import fsdp1_full_params

            return fsdp1_full_params(self.wrapped.model)
        full: Callable[[Any], torch.Tensor] = lambda p: p.full_tensor() if hasattr(p, "full_tensor") else p  # noqa: E731
        held = self.held if self.optimizer is not None else list(inner.named_parameters())  # ZeRO-2: whole already
        return {n: full(p).detach().clone() for n, p in held}

    def grads_equal_across_ranks(self) -> bool:
        """The truth check_grad_sync is held against: every local gradient (None as zeros) gathered whole and
        compared with rank 0's, NaN beside NaN counted equal."""
        world = dist.get_world_size()
        for param in self.wrapped.inner.parameters():
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            local = grad.detach().contiguous()
            everyone = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(everyone, local)
            for other in everyone[1:]:
                if not torch.equal(torch.nan_to_num(other, nan=7.25), torch.nan_to_num(everyone[0], nan=7.25)):
                    return False
        return True


def batch(seed: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed * 1000 + 10 * index + dist.get_rank())
    ids = torch.randint(0, CONFIG.vocab, (2, CONFIG.seq), generator=generator)
    return ids, torch.roll(ids, -1, dims=1)


TOLERANCE = 1e-6
RAISING = ("plain_forward_raises", "loss_raises")  # the routed twin skips the batch; the native one never sees it


def _event_facts(wrapper: str, routed: Twin, native: Twin, event: str, ids: torch.Tensor,
                 labels: torch.Tensor) -> dict[str, Any]:  # fmt: skip
    """Play ``event`` on both twins: what each raised, how far apart their parameters are, and what
    check_grad_sync says of the routed twin beside the truth (None: sharded, nothing replicated)."""
    outcomes = []
    for twin in (routed, native):
        if twin is native and event in RAISING:
            outcomes.append(None)  # the batch the loop skips: the truth never saw it
            continue
        try:
            twin.play(event, ids, labels)
            outcomes.append(None)
        except Exception as error:
            outcomes.append(f"{type(error).__name__}: {error}")
    a, b = routed.full_params(), native.full_params()
    report = check_grad_sync(routed.wrapped.model)
    return {
        "event": event,
        "routed_error": outcomes[0],
        "native_error": outcomes[1],
        "max_param_diff": max(float((a[n] - b[n]).abs().max()) for n in a),
        "reported_in_sync": report.in_sync,
        "compared": report.compared,
        "truth_in_sync": None if wrapper in SHARDED else routed.grads_equal_across_ranks(),
    }


def _check_event(wrapper: str, index: int, events: list[str], fact: dict[str, Any]) -> None:
    """After one event: the same outcome, the same parameters, and check_grad_sync telling the truth."""
    where = f"{wrapper}, event {index} of {events}: {fact}"
    assert fact["routed_error"] == fact["native_error"], where
    assert float(fact["max_param_diff"]) <= TOLERANCE, where
    if fact["truth_in_sync"] is None:  # sharded: nothing replicated, nothing reported
        assert fact["compared"] == 0, where
    else:
        assert fact["reported_in_sync"] == fact["truth_in_sync"], where


def play_and_check(wrapper: str, events: list[str], seed: int, folder: str) -> None:
    """Play ``events`` on both twins, each event's facts asserted as soon as it is played."""
    routed = Twin(wrapper, True, f"{folder}/routed")
    native = Twin(wrapper, False, f"{folder}/native")
    for index, event in enumerate(events):
        _check_event(wrapper, index, events, _event_facts(wrapper, routed, native, event, *batch(seed, index)))


def skewed_run_is_caught(folder: str) -> None:
    """The premise, native against native: two DDP twins, one of which skips an optimizer step (what a loss run
    outside the wrapper does to FSDP2: its gradients land where the optimizer does not look). The check passes
    the first event and rejects the skipped step, event 1."""
    first = Twin("ddp", False, f"{folder}/a")
    second = Twin("ddp", False, f"{folder}/b")
    events = ["train", "step", "train", "step"]
    rejected = None
    for index, event in enumerate(events):
        ids, labels = batch(0, index)
        first.play(event, ids, labels)
        if index != 1:
            second.play(event, ids, labels)
        a, b = first.full_params(), second.full_params()
        diff = max(float((a[n] - b[n]).abs().max()) for n in a)
        fact = {"routed_error": None, "native_error": None, "compared": 6, "reported_in_sync": True,
                "truth_in_sync": True, "max_param_diff": diff}  # fmt: skip
        if rejected is None:
            try:
                _check_event("ddp", index, events, fact)
            except AssertionError:
                rejected = index
    assert rejected == 1, f"the check rejected event {rejected} of {events}, not the skipped step (event 1)"
