"""Rank bodies for tests/test_trl.py: our ``ForwardRedirection`` and TRL's under DDP (module level: the pool
pickles them by reference). Real TRL trainer steps run ``wrapperroute.check.trl_cells.trl_step``, shared with
``check --trl``.

Gradient truth is the upstream measurement: after one training step, every parameter's gradient is compared
across ranks (one all-gather, ``ranklib.measure``); the ranks see different data.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from ranklib import measure, shifted_fused_ce
from torch.nn.parallel import DistributedDataParallel as DDP

from wrapperroute.check.models import TinyConfig, build_model
from wrapperroute.check.trl_layouts import whole_grads


def forward_redirection_ddp(use_trl: bool) -> dict[str, Any]:
    """Our ForwardRedirection (or TRL's) under DDP on the fused loss: gradients synced, forward restored."""
    redirection_class: Any
    if use_trl:
        from trl.models.utils import _ForwardRedirection as redirection_class
    else:
        from wrapperroute.integrations.trl import ForwardRedirection as redirection_class

    config = TinyConfig()
    ids = torch.randint(0, config.vocab, (2, config.seq), generator=torch.Generator().manual_seed(dist.get_rank()))
    model = build_model(config)
    ddp = DDP(model)
    loss = redirection_class()(ddp, model, shifted_fused_ce, model, ids)
    loss.backward()
    return {**measure(whole_grads(model)), "forward_left": "forward" in model.__dict__}
