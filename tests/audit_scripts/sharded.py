"""Training scripts whose every parameter is sharded, for the audit's verdict on how their gradients arrived:

- ``--layout head_unit --loss fused``: TRL's fused LM head in miniature (the model's forward reads
  ``lm_head.weight.full_tensor()``, never calling the head) on a head in its own FSDP2 unit: its gradient bypasses
  FSDP2's reduce-scatter. ``--loss routed``: the same loss through ``route_loss``, the head's unit gathered.
- ``--layout root``: the head in the root's group, the same fused forward: exact.
- ``--layout tp_dp`` (4 ranks): dp2 x tp2, the head ``ColwiseParallel`` over tp, FSDP2 over dp, the loss routed
  through ``wrapperroute.losses`` on the vocabulary-parallel head.
- ``--model trl``: TRL's own fused head (``trl.trainer.utils.add_fused_lm_head``, TRL >= 1.16) on a tiny Llama
  built from a config, ``--layout head_unit`` or ``root``; ``--patch``: under ``patch_trl()``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests folder: the fused-head model

import rankside_sharded

from wrapperroute import route_loss, token_divisor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=["head_unit", "root", "tp_dp"], required=True)
    parser.add_argument("--loss", choices=["fused", "routed"], default="fused")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", choices=["miniature", "trl"], default="miniature")
    parser.add_argument("--patch", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if args.layout == "tp_dp":
        from wrapperroute.check.losses import LOSSES, make_batch
        from wrapperroute.check.models import TinyConfig, build_model
        from wrapperroute.check.wrap_tp import build_tp

        wrapped = build_tp(build_model(TinyConfig()), {"tp": 2})
        model, case = wrapped.model, LOSSES["vocab_ce"]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(args.steps):
            batch = make_batch(case, TinyConfig(), wrapped.data_rank or 0, step, 0, 2, True)
            divisor = token_divisor(model, case.count(batch))  # type: ignore[misc]
            loss = route_loss(model, model, case.summed, model, batch, {}) / divisor  # type: ignore[arg-type]
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    elif args.model == "trl":
        import rankside_trl_fused_head as trl_case
        from trl.trainer import utils

        from wrapperroute.integrations.trl import patch_trl

        if args.patch:
            patch_trl()
        model = trl_case.tiny_llama()
        utils.add_fused_lm_head(model)
        trl_case.shard(model, args.layout)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(args.steps):
            ids, labels = trl_case.batch(rank + 2 * step)
            divisor = token_divisor(model, trl_case.valid(labels))
            model(input_ids=ids, labels=labels, fused_lm_head=True, num_items_in_batch=divisor).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            print(f"rank {rank} step {step}", flush=True)
    else:
        model = rankside_sharded.fused_model()
        rankside_sharded.shard(model, args.layout)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(args.steps):
            ids, labels = rankside_sharded.batch(rank, step)
            divisor = token_divisor(model, int((labels != rankside_sharded.IGNORE).sum()))
            loss = rankside_sharded.step_loss(model, ids, labels, args.loss == "routed") / divisor
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
