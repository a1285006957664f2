"""Scripts that end otherwise: ``--case raises`` (a ValueError after one step), ``nothing`` (no optimizer
step), ``sleep`` (steps until interrupted), ``exit7`` (``sys.exit(7)``), ``guard`` (the script's own
``GradSyncError`` after one step)."""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=["raises", "nothing", "sleep", "exit7", "guard"], required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    model = DistributedDataParallel(torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if args.case == "nothing":
        print("no training here", flush=True)
        return
    for step in range(10**6):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        if args.case == "raises":
            raise ValueError(f"the script's own failure at step {step}")
        if args.case == "guard":
            from wrapperroute import GradSyncError

            raise GradSyncError("the script's own guard")
        if args.case == "exit7":
            sys.exit(7)
        print(f"rank {dist.get_rank()} running step {step}", flush=True)
        time.sleep(0.2)


if __name__ == "__main__":
    main()
