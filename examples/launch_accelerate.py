"""accelerate on CPU ranks:  accelerate launch --multi_gpu --num_processes 2 examples/launch_accelerate.py
(`--multi_gpu` selects accelerate's torchrun launcher; `Accelerator(cpu=True)` then runs DDP over gloo.
`--cpu` would start a single process.)"""

from __future__ import annotations

import os
import sys

import torch
from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(__file__))
import _common

from wrapperroute import detect, route_loss


def main() -> None:
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(_common.model())
    inner = accelerator.unwrap_model(model)
    loss = route_loss(model, inner, _common.fused_ce, inner, _common.batch(accelerator.process_index))
    accelerator.backward(loss)
    grad = inner.lm_head.weight.grad
    agree = bool((accelerator.gather(grad[None]) == grad).all())
    print(f"rank {accelerator.process_index}: {detect(model).chain} loss={loss.item():.4f} ranks_agree={agree}")
    accelerator.end_training()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
