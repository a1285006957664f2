"""``wrapperroute audit``: prove that an unmodified training script keeps its data-parallel replicas in sync.

``torchrun --nproc-per-node N -m wrapperroute audit train.py ARGS`` runs ``train.py`` on every rank as
``__main__``. Global optimizer step hooks compare every replicated gradient and parameter across ranks at
each audited step (signatures exchanged before the step, the verdict after it; suspects in full), on a side
process group; see ``session.py`` for when and ``replicas.py`` for what. What it cannot see: gradients a
script averages by hand without a wrapper (no wrapper holds them, and the final line says so), state outside
parameters and gradients (optimizer moments, buffers), and tensors sharded by design (FSDP, ZeRO-3), which fail
loudly instead of drifting.
"""

from __future__ import annotations

from .runner import main
from .session import AUDIT_FAILED_EXIT, DESYNC_EXIT, Audit

__all__ = ["AUDIT_FAILED_EXIT", "DESYNC_EXIT", "Audit", "main"]
