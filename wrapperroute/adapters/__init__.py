"""One adapter per wrapper family, and the protocols they are made of: every adapter is a
:class:`~wrapperroute.adapters.layer.Layer` (peeled by :func:`wrapperroute.detect`); one that ``route_loss``
enters has :class:`~wrapperroute.adapters.routing.Routing`; a distributed wrapper has
:class:`~wrapperroute.adapters.topology.Topology` too. Capabilities a few wrappers add: :class:`AroundLoss`,
:class:`Isolating`, :class:`ShardUnits` (routing), :class:`ArmsInForward` (topology), :class:`ReadWhole`.

The built-in adapters register here through :func:`register_adapter`, the door a user's own wrapper comes in by;
the optional families (DeepSpeed, PEFT, Lightning Fabric) by their import path, made once their package is
imported.
"""

from __future__ import annotations

from ._hooks import modules_being_called
from .compile import CompileLayer
from .ddp import DDPAdapter
from .fsdp1 import FSDP1Adapter
from .fsdp2 import FSDP2Adapter, ReplicateFSDPAdapter
from .layer import Layer
from .registry import register_adapter, registered
from .replicate import ReplicateAdapter
from .routing import AroundLoss, Isolating, Routing, ShardUnits
from .topology import ArmsInForward, Assigned, Averaging, Replica, Topology, replicated, sharded
from .whole import ReadWhole

register_adapter(CompileLayer())
register_adapter(DDPAdapter())
register_adapter(FSDP1Adapter())
register_adapter(FSDP2Adapter())
register_adapter(ReplicateFSDPAdapter())
register_adapter(ReplicateAdapter())
register_adapter("wrapperroute.adapters.deepspeed:DeepSpeedAdapter", once_imported="deepspeed")
register_adapter("wrapperroute.adapters.peft:PeftLayer", once_imported="peft")
register_adapter("wrapperroute.adapters.fabric:FabricAdapter", once_imported="lightning")
register_adapter("wrapperroute.adapters.fabric:StandaloneFabricAdapter", once_imported="lightning_fabric")

__all__ = [
    "ArmsInForward", "AroundLoss", "Assigned", "Averaging", "Isolating", "Layer", "ReadWhole", "Replica", "Routing",
    "ShardUnits", "Topology", "modules_being_called", "register_adapter", "registered", "replicated", "sharded",
]  # fmt: skip
