"""One adapter per wrapper family: :class:`~wrapperroute.adapters.base.Adapter` for those routed through,
:class:`~wrapperroute.adapters.base.Layer` for those only peeled.

Optional families (DeepSpeed, PEFT, Lightning Fabric) are consulted only once their package is imported: a
model cannot be a ``DeepSpeedEngine`` unless ``deepspeed`` was imported, so wrapperroute never imports it itself.
"""

from __future__ import annotations

import sys

from ._hooks import modules_being_called
from ._units import output_embedding
from .base import Adapter, Assigned, Averaging, Layer, Replica
from .compile import CompileLayer
from .ddp import DDPAdapter
from .fsdp1 import FSDP1Adapter
from .fsdp2 import FSDP2Adapter, ReplicateFSDPAdapter
from .replicate import ReplicateAdapter

_CORE: tuple[Layer, ...] = (
    CompileLayer(),
    DDPAdapter(),
    FSDP1Adapter(),
    FSDP2Adapter(),
    ReplicateFSDPAdapter(),
    ReplicateAdapter(),
)
# package name -> (module path, adapter class name)
_OPTIONAL: dict[str, tuple[str, str]] = {
    "deepspeed": ("wrapperroute.adapters.deepspeed", "DeepSpeedAdapter"),
    "peft": ("wrapperroute.adapters.peft", "PeftLayer"),
    "lightning": ("wrapperroute.adapters.fabric", "FabricAdapter"),
    "lightning_fabric": ("wrapperroute.adapters.fabric", "StandaloneFabricAdapter"),
}
_loaded_optional: dict[str, Layer] = {}


def registered() -> tuple[Layer, ...]:
    """The layers and adapters to consult, core first, then those whose package is already imported."""
    for package, (module_path, class_name) in _OPTIONAL.items():
        if package not in _loaded_optional and package in sys.modules:
            module = __import__(module_path, fromlist=[class_name])
            _loaded_optional[package] = getattr(module, class_name)()
    if not _loaded_optional:
        return _CORE
    return _CORE + tuple(_loaded_optional.values())


__all__ = [
    "Adapter", "Assigned", "Averaging", "Layer", "Replica", "modules_being_called", "output_embedding", "registered",
]  # fmt: skip
