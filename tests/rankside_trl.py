"""Rank bodies for tests/test_trl.py: our ``ForwardRedirection`` and TRL's under DDP (module level: the pool
pickles them by reference). Real TRL trainer steps run ``wrapperroute.check.trl_cells.trl_step``, shared with
``check --trl``.

Gradient truth is the upstream measurement: after one training step, every parameter's gradient is compared
across ranks (one all-gather, ``ranklib.measure``) and asserted there; the ranks see different data.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from ranklib import measure, shifted_fused_ce
from torch.nn.parallel import DistributedDataParallel as DDP

from wrapperroute.check.models import TinyConfig, build_model
from wrapperroute.check.trl_layouts import whole_grads


def forward_redirection_ddp(use_trl: bool) -> None:
    """Our ForwardRedirection (or TRL's) under DDP on the fused loss: gradients synced (bit-equal, ours), and
    ours restores the forward, where TRL's leaves an instance forward behind."""
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
    cell = measure(whole_grads(model))
    whose = "TRL's" if use_trl else "ours"
    assert cell["differ"] == 0, f"{whose}: gradients differ across ranks: {cell}"
    left = "forward" in model.__dict__
    if use_trl:
        assert left, "TRL's redirection no longer leaves an instance forward: the comparison is stale"
    else:
        assert cell["max_diff"] == 0.0, f"ours: gradients not bit-equal across ranks: {cell}"
        assert not left, "ours left an instance forward on the model"
