"""Shared by the FSDP adapters: which modules are shard units, and which nested unit owns a module the loss reads.

A fused loss reads ``lm_head.weight`` directly. When ``lm_head`` is its own shard unit, the root's forward
does not unshard it: only that unit's own forward does. So we route through that unit's forward too, which
also registers its post-backward reduce-scatter exactly as a normal forward would.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from torch import nn

from .._head import output_embedding
from .._torch_internals import loaded_class


class UnitFamily:
    """The shard units of one wrapper family (FSDP1's ``FullyShardedDataParallel``, FSDP2's ``FSDPModule``): told
    by their class, read where its module is loaded (``"module:Class"``, the first of ``where`` found), since no
    unit exists before it is; and the units a loss enters, the output embedding's found once per wrapper."""

    def __init__(self, *where: str) -> None:
        self.where = where
        self._picked: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref[nn.Module], ...]] = (
            weakref.WeakKeyDictionary()
        )

    def loaded(self) -> type | None:
        """The units' class, or None while its module is not loaded (no unit exists yet)."""
        found: type | None = loaded_class(*self.where)
        return found

    def has(self, module: nn.Module) -> bool:
        """Whether ``module`` is a unit of this family."""
        unit = self.loaded()
        return unit is not None and isinstance(module, unit)

    def to_enter(self, wrapper: nn.Module, inner: nn.Module, gather: tuple[nn.Module, ...]) -> tuple[nn.Module, ...]:
        """The nested units whose forward the loss runs through (outermost first): :func:`units_for`."""
        return units_for(wrapper, inner, gather, self.has, self._picked)


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
