"""``token_divisor(model, count)``: what a summed loss is divided by so that, once the wrapper has reduced the
gradients, they are exactly those of the mean over every valid token of the global batch.

A loss that is each rank's mean over its own valid tokens, averaged by the wrapper, weighs a token by one over
(ranks x that rank's count): a different objective from the mean over the global batch as soon as ranks, or
micro-batches, hold different numbers of valid tokens (padding, prompt masks, packing, a sequence split over
context-parallel ranks). Summed instead, and divided by ``N / D`` on every rank (``N`` the valid tokens of the whole
optimizer step on every rank whose gradients the wrapper reduces together, ``D`` what the wrapper divides their
sum by), every token weighs ``1 / N``. Which ranks and what ``D`` are the wrapper's to say
(:meth:`~wrapperroute.adapters.Topology.averaging`): DDP's process group, FSDP's mesh (HSDP's two dimensions,
a flattened data x context mesh: context-parallel ranks hold different tokens and are counted), DeepSpeed's
data-parallel group and its division of each micro-batch's loss by ``gradient_accumulation_steps``.
Tensor-parallel ranks read the same tokens and are not in the wrapper's group: they are not counted twice.
"""

from __future__ import annotations

import numbers
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._groups import collective_device, initialized, side_group, world_size
from .adapters import Averaging
from .detect import Detection, detect, enclosing_wrapper, trains_alone
from .errors import RouteValueError, UnroutedModelWarning, callers_level

__all__ = ["token_divisor"]

_said: set[str] = set()  # what could not be read, said once per process


def token_divisor(model: nn.Module, count: int | torch.Tensor) -> torch.Tensor:
    """The divisor of a summed loss that makes the reduced gradients those of the mean over every valid token of
    the global batch: ``loss_sum / token_divisor(model, count)``. Call it on every rank, once per optimizer step
    (inside ``no_sync`` too), before the step's backward passes.

    ``model`` is what the trainer holds (the DDP, FSDP or DeepSpeed wrapper, the Fabric module), or, inside a
    routed loss or a Lightning ``training_step``, the unwrapped module: the wrapper whose forward this thread runs
    is used. ``count`` is this rank's number of valid (not ignored) tokens, or sequences, for the whole optimizer
    step, every micro-batch included: an ``int`` or a one-element tensor (0 on a rank that holds only padding).

    Returns a 0-d tensor in the default dtype, ``sum of counts / D``: the counts summed over the ranks whose
    gradients the wrapper reduces together (one all-reduce of two numbers, then one read of the result, which
    waits for the device), ``D`` what the wrapper divides that reduction by, times what its backward divides a
    micro-batch's loss by (DeepSpeed's ``gradient_accumulation_steps``). With no wrapper: the count itself.

    A negative, fractional or non-numeric count on any rank, or no valid token on any rank, raises
    :class:`~wrapperroute.RouteValueError` on every rank (no rank is left waiting).
    """
    return divisor(count, averaging_of(model))


def averaging_of(model: nn.Module) -> Averaging:
    """How ``model``'s wrapper (or the wrapper whose forward this thread runs around it) reduces gradients; one
    rank alone with no wrapper. What the wrapper's state does not tell is said once, as a warning."""
    found = detect(model)
    wrapper, adapter = found.wrapper, found.adapter
    if wrapper is None:
        enclosing = enclosing_wrapper(found.inner)
        if enclosing is not None:
            inside = detect(enclosing)
            wrapper, adapter = inside.wrapper, inside.adapter
    if wrapper is None or adapter is None:
        _say_alone(model, found)
        return Averaging((_rank(),), None, 1.0)
    averaging = adapter.averaging(wrapper)
    if averaging is None:
        raise RouteValueError(
            f"token_divisor cannot tell which ranks the {adapter.kind} wrapper of {type(found.inner).__name__} "
            "reduces gradients over, or what it divides them by (parameter groups on different meshes or with "
            "different divide factors, or hybrid sharding over groups given by hand). Divide the summed loss "
            "by the global count over the data-parallel ranks, times their number, yourself."
        )
    if averaging.unread and averaging.unread not in _said:
        _said.add(averaging.unread)
        warnings.warn(f"wrapperroute.token_divisor: {averaging.unread}", RuntimeWarning, stacklevel=3)
    return averaging


def divisor(count: Any, averaging: Averaging) -> torch.Tensor:
    """``count`` summed over ``averaging.ranks`` (checked on each; none to sum with for a one-rank averaging) over
    what the wrapper and its backward divide by."""
    group = averaging.group
    if group is None and len(averaging.ranks) > 1 and averaging.ranks != tuple(range(dist.get_world_size())):
        group = side_group(averaging.ranks)  # HSDP's two dimensions: no group of the wrapper's spans them
    device = collective_device(group) if initialized() else torch.device("cpu")
    sent, problem = _as_sent(count, device)
    mine = sent.clone()  # this rank's own [value, bad], read with the reduced result (one read, one wait)
    if len(averaging.ranks) > 1:
        dist.all_reduce(sent, group=group)
    total, bad, _, own_bad = torch.cat([sent, mine]).tolist()
    if problem is None and own_bad:  # a tensor's bad value: read now, with the result
        problem = _bad_value(float(count))
    if problem is not None:
        raise RouteValueError(f"token_divisor: {problem} (raised on every rank of the group)")
    if bad:
        raise RouteValueError(
            f"token_divisor: {int(bad)} other rank(s) of the {len(averaging.ranks)} that reduce gradients together "
            "gave a count that is not a whole number of tokens >= 0 (their error says which)"
        )
    if total == 0:
        raise RouteValueError(
            f"token_divisor: no valid token on any of the {len(averaging.ranks)} rank(s) that reduce gradients "
            "together (every label ignored): the mean over no token is undefined. Skip this step, or check the "
            "labels' ignore_index."
        )
    out = count.device if isinstance(count, torch.Tensor) else device
    value = total / (averaging.divides_by * averaging.backward_divides_by)
    return torch.tensor(value, dtype=torch.get_default_dtype(), device=out)


def _as_sent(count: Any, device: torch.device) -> tuple[torch.Tensor, str | None]:
    """``[count, 1 if it is bad else 0]`` in float64 on ``device`` (exact for every count below 2**53), and what is
    wrong with a count that is not a tensor (a tensor's value is checked on its device)."""
    bad_input = torch.tensor([0.0, 1.0], dtype=torch.float64, device=device)
    if isinstance(count, torch.Tensor):
        if count.numel() != 1 or count.dtype == torch.bool or count.is_complex():
            return bad_input, f"count must be one number, got a {count.dtype} tensor of shape {tuple(count.shape)}"
        value = count.detach().reshape(()).to(device=device, dtype=torch.float64)
        bad = ((value < 0) | (value != value.floor()) | ~torch.isfinite(value)).to(torch.float64)
        # checked on its device: which value was bad is read with the reduced result, not before
        return torch.stack([torch.where(bad > 0, 0.0, value), bad]), None
    if isinstance(count, numbers.Real) and not isinstance(count, bool):
        problem = _bad_value(float(count))
        sent = [0.0, 1.0] if problem else [float(count), 0.0]
        return torch.tensor(sent, dtype=torch.float64, device=device), problem
    return bad_input, f"count must be an int or a one-element tensor (this rank's tokens), got {type(count).__name__}"


def _bad_value(value: float) -> str | None:
    if value != value or value in (float("inf"), float("-inf")):
        return f"count is {value}, not a number of tokens"
    if value < 0:
        return f"count is {value:g}: a number of tokens is never negative"
    if value != int(value):
        return f"count is {value:g}: a number of tokens is a whole number"
    return None


def _rank() -> int:
    return dist.get_rank() if initialized() else 0


def _say_alone(model: nn.Module, found: Detection) -> None:
    """Several ranks, trainable parameters, no wrapper: the divisor is this rank's own count, which is right only
    if nothing averages these gradients (tensor parallelism over every rank): said, not passed over."""
    if not trains_alone(model, found):
        return
    warnings.warn(
        f"wrapperroute.token_divisor got a {type(model).__name__} with trainable parameters and no distributed "
        f"wrapper while {world_size()} ranks run: the divisor is this rank's own count. Pass the model your "
        "trainer holds (the DDP, FSDP or DeepSpeed wrapper, the Fabric module), or call it inside the routed loss.",
        UnroutedModelWarning,
        stacklevel=callers_level(),
    )
