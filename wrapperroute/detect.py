"""``detect(model)``: which wrapper is this, and what is inside it."""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ._groups import world_size
from ._tensor_parallel import TensorParallel, tensor_parallel_layout
from .adapters import Layer, Routing, Topology, modules_being_called, registered
from .adapters.registry import on_change
from .errors import RouteTypeError

_MAX_LAYERS = 32  # a chain deeper than this is a cycle, not a model

# Types no adapter claims. Claims are isinstance checks, so they depend on the type alone; a type cannot start
# being claimed later (a DeepSpeedEngine type does not exist before deepspeed is imported, and fully_shard
# gives the module a new class). This keeps route_loss on a plain module within a microsecond of calling fn.
plain_types: set[type] = set()
on_change(plain_types.clear)  # an adapter registered since may claim one


@dataclass(frozen=True)
class Peeled:
    """One layer of a model, outermost first: the module, and the layer family that claimed it (``None`` for the
    innermost module)."""

    module: nn.Module = field(repr=False)
    layer: Layer | None

    @property
    def kind(self) -> str:
        return self.layer.kind if self.layer is not None else "module"


@dataclass(frozen=True)
class Detection:
    """What :func:`detect` found.

    kind
        ``"none"`` or the outermost distributed wrapper's family: ``"ddp"``, ``"replicate"`` (torch's
        composable DDP), ``"fsdp1"``, ``"fsdp2"``, ``"replicate_fsdp"`` (``replicate`` built on FSDP2),
        ``"deepspeed"``.
    chain
        The layers' kinds, outermost first, ending with ``"module"``: e.g. ``("compile", "ddp", "module")``.
    wrapper
        The distributed wrapper whose forward :func:`route_loss` calls (``None`` when ``kind == "none"``).
    inner
        The innermost module: what a trainer calls the unwrapped model.
    details
        Family-specific facts (``{"zero_stage": 3}``, DDP flags...).
    entry
        The layer whose forward :func:`~wrapperroute.route_loss` calls: the wrapper, or an outer layer whose
        own forward must run around it (Lightning Fabric's precision context). ``None`` when nothing is routed.
    tensor_parallel
        The tensor-parallel layout of the parameters, beside the data-parallel wrapper (``None`` without one):
        which mesh dimensions shard which parameters, and whether the head's vocabulary is sharded and over
        which ranks. Read from every parameter on first access (not on the routed path).
    peeled
        Each layer: its module and the family that claimed it (``chain`` and ``layers`` read from it).
    """

    kind: str
    peeled: tuple[Peeled, ...] = field(repr=False)
    wrapper: nn.Module | None = field(repr=False)
    inner: nn.Module = field(repr=False)
    details: dict[str, Any] = field(default_factory=dict)
    adapter: Topology | None = field(default=None, repr=False, compare=False)
    entry: nn.Module | None = field(default=None, repr=False, compare=False)
    entry_adapter: Routing | None = field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:
        return f"Detection(kind={self.kind!r}, chain={self.chain!r}, details={self.details!r})"

    @functools.cached_property
    def tensor_parallel(self) -> TensorParallel | None:
        own = self.adapter.meshes(self.wrapper) if self.wrapper is not None and self.adapter is not None else ()
        return tensor_parallel_layout(self.inner, own)

    @property
    def distributed(self) -> bool:
        return self.wrapper is not None

    @property
    def chain(self) -> tuple[str, ...]:
        return tuple(each.kind for each in self.peeled)

    @property
    def layers(self) -> tuple[nn.Module, ...]:
        return tuple(each.module for each in self.peeled)


def detect(model: nn.Module) -> Detection:
    """Peel every known layer off ``model`` and report the outermost distributed wrapper.

    Sees through ``torch.compile``, DDP, composable ``replicate``, FSDP1, FSDP2, DeepSpeed engines, PEFT
    models and Lightning Fabric modules in any order. Accelerate adds no layer of its own (it returns these same
    wrappers), so it needs no entry.
    """
    if not isinstance(model, nn.Module):
        raise RouteTypeError(
            f"model must be a torch.nn.Module (the wrapped model your trainer calls), got {type(model).__name__}"
        )
    known = registered()
    peeled: list[Peeled] = []
    wrapper: nn.Module | None = None
    wrapper_adapter: Topology | None = None
    entry: nn.Module | None = None
    entry_adapter: Routing | None = None
    module = model
    applied: set[tuple[int, int]] = set()  # (id(adapter), id(module)): FSDP2 peels to the same object
    while len(peeled) < _MAX_LAYERS and type(module) not in plain_types:
        for layer in known:
            key = (id(layer), id(module))
            if key not in applied and layer.claims(module):
                applied.add(key)
                peeled.append(Peeled(module, layer))
                if wrapper is None:
                    if isinstance(layer, Topology):
                        wrapper, wrapper_adapter = module, layer
                    elif isinstance(layer, Routing) and entry is None:  # only a layer entered outside the wrapper
                        entry, entry_adapter = module, layer
                module = layer.peel(module)
                break
        else:
            if not peeled or peeled[-1].module is not module:  # FSDP2 claims a module and peels to itself
                plain_types.add(type(module))
            break
    peeled.append(Peeled(module, None))
    if wrapper is None or wrapper_adapter is None:
        return Detection("none", tuple(peeled), None, module, {}, None, entry, entry_adapter)
    if entry is None and isinstance(wrapper_adapter, Routing):
        entry, entry_adapter = wrapper, wrapper_adapter
    details = wrapper_adapter.describe(wrapper)
    return Detection(wrapper_adapter.kind, tuple(peeled), wrapper, module, details, wrapper_adapter, entry,
                     entry_adapter)  # fmt: skip


def enclosing_wrapper(model: nn.Module) -> nn.Module | None:
    """The distributed wrapper whose forward this thread is running and that contains ``model``, or None."""
    distributed = [adapter for adapter in registered() if isinstance(adapter, Topology)]
    for module in modules_being_called(sys._getframe(1)):
        if (
            module is not model
            and any(adapter.claims(module) for adapter in distributed)
            and any(sub is model for sub in module.modules())
        ):
            return module
    return None


def trains_alone(model: nn.Module, found: Detection) -> bool:
    """Whether ``model``, on which ``found`` shows no distributed wrapper, may be training a copy of its own on each
    rank: several ranks run, it has trainable parameters, and it is not a tensor-parallel model whose mesh spans
    every rank (whose ranks hold slices of one model, not replicas)."""
    world = world_size()
    if world < 2 or not any(p.requires_grad for p in model.parameters()):
        return False
    layout = found.tensor_parallel
    return layout is None or not set(layout.mesh_ranks) >= set(range(world))
