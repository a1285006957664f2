"""Shared by the FSDP adapters: which nested shard unit owns a module the loss reads.

A fused loss reads ``lm_head.weight`` directly. When ``lm_head`` is its own shard unit, the root's forward
does not unshard it: only that unit's own forward does. So we route through that unit's forward too, which
also registers its post-backward reduce-scatter exactly as a normal forward would.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from torch import nn


def output_embedding(model: nn.Module) -> nn.Module | None:
    """The module a fused loss reads by convention: HF's output embeddings, else ``lm_head``."""
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        try:
            found = getter()
        except (AttributeError, NotImplementedError):
            found = None
        if isinstance(found, nn.Module):
            return found
    head = getattr(model, "lm_head", None)
    return head if isinstance(head, nn.Module) else None


def owning_units(
    root: nn.Module, modules: tuple[nn.Module, ...], is_unit: Callable[[nn.Module], bool]
) -> tuple[nn.Module, ...]:
    """For each module, the innermost shard unit below ``root`` containing it (``root`` itself needs no
    extra step), outermost first, without duplicates."""
    units: list[nn.Module] = []
    for target in modules:
        owner: nn.Module | None = None
        for candidate in root.modules():
            if candidate is root or not is_unit(candidate):
                continue
            if any(sub is target for sub in candidate.modules()):
                owner = candidate  # modules() is pre-order, so a later match is deeper
        if owner is not None and all(owner is not u for u in units):
            units.append(owner)
    return tuple(units)


def units_for(
    wrapper: nn.Module,
    inner: nn.Module,
    gather: tuple[nn.Module, ...],
    is_unit: Callable[[nn.Module], bool],
    auto_cache: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref[nn.Module], ...]],
) -> tuple[nn.Module, ...]:
    """The units to enter for ``gather``, or, when it is empty, for the output embedding (found once per
    wrapper: the module tree does not change after wrapping).

    The cache holds the units weakly: a unit reaches its root through FSDP's state, and a strong value would
    keep its own weak key (the wrapper, so the whole model) alive for good.
    """
    if gather:
        return owning_units(wrapper, gather, is_unit)
    cached = auto_cache.get(wrapper)
    if cached is not None:
        units = tuple(ref() for ref in cached)
        if all(unit is not None for unit in units):
            return units  # type: ignore[return-value]  # checked: none is None
    head = output_embedding(inner)
    found = owning_units(wrapper, (head,), is_unit) if head is not None else ()
    auto_cache[wrapper] = tuple(weakref.ref(unit) for unit in found)
    return found
