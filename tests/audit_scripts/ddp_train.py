"""A plain DDP training script, as users write them. ``--loss module`` computes the fused loss from
``model.module`` (the pattern that skips DDP's forward: every rank trains its own model); ``--loss routed``
through ``model(...)``-equivalent routing; ``--module-from K``: routed, then from step K (0-based) through
``model.module``; ``--accum N`` accumulates N-1 micro-batches under ``no_sync()``.
``--nan`` makes a loss or a parameter NaN on some ranks. Prints one line per step with the loss, bit-exact
(``float.hex``), for the numerics comparison."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from wrapperroute import route_loss
from wrapperroute.check.models import TinyConfig, build_model


def fused_ce(inner: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = inner(ids) @ inner.lm_head.weight.t()
    return F.cross_entropy(logits.flatten(0, 1), torch.roll(ids, -1, 1).flatten())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loss", choices=["module", "routed"], default="routed")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--module-from", type=int, default=None)
    parser.add_argument("--destroy", action="store_true", help="destroy the process group at the end")
    # torch 2.13's gloo teardown aborts about 3 process exits in 10 (SIGABRT after the script's last line); a
    # run read only for its losses leaves without that teardown, as the audited process does
    parser.add_argument("--leave", action="store_true", help="end with os._exit(0) once the output is flushed")
    parser.add_argument(
        "--nan",
        choices=["none", "rank1", "every", "param"],
        default="none",
        help="make the first step's loss NaN on rank 1, or on every rank; param: write NaN into "
        "one of rank 1's parameters after wrapping (its loss and, through the all-reduce, every "
        "rank's gradients and parameters become NaN: alike everywhere after the first step)",
    )
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = TinyConfig()
    inner = build_model(config)
    model = DistributedDataParallel(inner)
    if args.nan == "param" and rank == 1:
        with torch.no_grad():
            inner.blocks[0].proj.weight[0, 0] = float("nan")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        for micro in range(args.accum):
            ids = torch.randint(0, config.vocab, (2, config.seq), generator=generator)
            with model.no_sync() if micro < args.accum - 1 else contextlib.nullcontext():
                if args.loss == "module" or (args.module_from is not None and step >= args.module_from):
                    loss = fused_ce(model.module, ids)
                else:
                    loss = route_loss(model, inner, fused_ce, inner, ids)
                if step == 0 and (args.nan == "every" or (args.nan == "rank1" and rank == 1)):
                    loss = loss * float("nan")
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"rank {rank} step {step} loss {loss.item().hex()}", flush=True)
    if args.destroy:
        dist.destroy_process_group()
    if args.leave:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
