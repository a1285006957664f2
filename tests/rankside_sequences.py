"""Rank bodies for tests/test_sequences.py: a training sequence played on a routed model and on its native twin.

The twins start from the same weights under the same wrapper. The native twin computes its loss through
``model(...)``: its forward calls the head module. The routed twin calls ``route_loss`` with the fused pattern:
the backbone, then the head's weight read directly. Both take the same events in the same order; after each,
every parameter of the two is compared, and ``check_grad_sync`` is held against the truth measured here, by an
all-gather of every local gradient.

After a forward that raised, the native twin's loop follows the wrapper's documented recovery where there is
one (FSDP2: ``reset_iter_state()``; without it FSDP2's next forward reuses the parameters the failed forward
gathered, measured stale after an optimizer step). The routed twin's loop calls nothing: routing repairs what
the failed forward left. FSDP1 documents no recovery, and natively after a forward that raised it refuses
``no_sync`` and reuses stale parameters: its sequences hold no raising event (routing through FSDP1 after one is
held against one process instead: tests/test_run_states.py).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
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
            assert self.optimizer is not None
            self.optimizer.step()
        elif event == "zero_grad":
            assert self.optimizer is not None
            self.optimizer.zero_grad(set_to_none=True)
        elif event == "plain_forward":
            self.wrapped.model(ids)  # a forward whose output is used for nothing (a probe, a metric)
        elif event == "plain_forward_raises":
            with self.skipped(IndexError):  # a token id out of range: the batch the loop skips
                self.wrapped.model(torch.full_like(ids, CONFIG.vocab + 3))
        elif event == "loss_raises":
            with self.skipped(ValueError):
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

    @contextlib.contextmanager
    def skipped(self, error: type[Exception]) -> Iterator[None]:
        """The loop's ``except``: the batch is skipped; natively, the wrapper's documented recovery follows."""
        try:
            yield
        except error:
            reset = getattr(self.wrapped.model, "reset_iter_state", None)  # FSDP2 (torch >= 2.13)
            if not self.routed and callable(reset):
                reset()

    def save(self) -> None:
        if self.engine is not None:
            self.engine.save_checkpoint(self.folder, tag="twin")
            self.saved = True
            return
        from torch.distributed.checkpoint.state_dict import get_state_dict

        assert self.optimizer is not None
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


def play(wrapper: str, events: list[str], seed: int, folder: str) -> list[dict[str, Any]]:
    """Play ``events`` on both twins; after each, what differs between them and what check_grad_sync says."""
    routed = Twin(wrapper, True, f"{folder}/routed")
    native = Twin(wrapper, False, f"{folder}/native")
    facts = []
    for index, event in enumerate(events):
        ids, labels = batch(seed, index)
        outcomes = []
        for twin in (routed, native):
            try:
                twin.play(event, ids, labels)
                outcomes.append(None)
            except Exception as error:
                outcomes.append(f"{type(error).__name__}: {error}")
        a, b = routed.full_params(), native.full_params()
        diffs = [float((a[n] - b[n]).abs().max()) for n in a]
        report = check_grad_sync(routed.wrapped.model)
        truth = None if wrapper in SHARDED else routed.grads_equal_across_ranks()
        facts.append({
            "event": event,
            "routed_error": outcomes[0],
            "native_error": outcomes[1],
            "max_param_diff": max(diffs),
            "bit_equal": all(torch.equal(a[n], b[n]) for n in a),
            "finite": all(bool(torch.isfinite(t).all()) for t in a.values()),
            "reported_in_sync": report.in_sync,
            "compared": report.compared,
            "truth_in_sync": truth,
        })  # fmt: skip
    return facts


TOLERANCE = 1e-6


def check(wrapper: str, facts: list[dict[str, Any]], events: list[str]) -> None:
    """After every event: the same outcome, the same parameters, and check_grad_sync telling the truth."""
    for index, fact in enumerate(facts):
        where = f"{wrapper}, event {index} of {events}: {fact}"
        assert fact["routed_error"] == fact["native_error"], where
        assert float(fact["max_param_diff"]) <= TOLERANCE, where
        if fact["truth_in_sync"] is None:  # sharded: nothing replicated, nothing reported
            assert fact["compared"] == 0, where
        else:
            assert fact["reported_in_sync"] == fact["truth_in_sync"], where


def play_and_check(wrapper: str, events: list[str], seed: int, folder: str) -> None:
    check(wrapper, play(wrapper, events, seed, folder), events)


def play_skewed(folder: str) -> list[dict[str, Any]]:
    """Two native DDP twins, one of which skips an optimizer step (what a loss run outside the wrapper does to
    FSDP2: its gradients land where the optimizer does not look): the facts the check must reject."""
    first = Twin("ddp", False, f"{folder}/a")
    second = Twin("ddp", False, f"{folder}/b")
    facts = []
    for index, event in enumerate(["train", "step", "train", "step"]):
        ids, labels = batch(0, index)
        first.play(event, ids, labels)
        if index != 1:
            second.play(event, ids, labels)
        a, b = first.full_params(), second.full_params()
        diff = max(float((a[n] - b[n]).abs().max()) for n in a)
        facts.append({"routed_error": None, "native_error": None, "compared": 6, "reported_in_sync": True,
                      "truth_in_sync": True, "max_param_diff": diff})  # fmt: skip
    return facts
