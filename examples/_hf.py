"""Shared by the transformers/TRL examples: a callback that proves the step's gradients are in sync."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from transformers import TrainerCallback

from wrapperroute import check_grad_sync


class GradCheck(TrainerCallback):
    """After the backward, before the optimizer: how many gradients differ across ranks."""

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> None:
        report = check_grad_sync(model)
        if dist.get_rank() == 0:
            print(
                f"step {state.global_step}: {report.differing}/{report.compared} parameters differ "
                f"(max {report.max_abs_diff:.1e})",
                flush=True,
            )
