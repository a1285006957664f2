"""What ``wrapperroute audit`` costs a training step: audited / plain, same run, interleaved.

    python3 benchmarks/audit_cost.py                  # ~10M-parameter DDP model, 2 CPU ranks (a few minutes)
    python3 benchmarks/audit_cost.py --wrapper fsdp2  # the same model fully sharded: every block and the root
    python3 benchmarks/audit_cost.py --quick          # a smoke run

Each repetition times a block of optimizer steps with the audit's hook installed and a block without, in
alternating order; the ratio is the median of the per-repetition ratios. ``every step``: ``--steps all``;
``default``: ``--steps 3`` over a 100-step block (what a run pays once its first three steps are audited).
Under FSDP2 no parameter has a copy: what an audited step costs there is the look at how each sharded gradient
arrived (arrivals.py) and its exchange.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import bench_ranks  # noqa: E402

from wrapperroute.audit.session import PARAMS_EVERY  # noqa: E402
from wrapperroute.ranks import RankPool  # noqa: E402


def audited_step_ratio(size: str, reps: int, steps: int | None, block: int, wrapper: str = "ddp") -> dict[str, Any]:
    """On every rank: ``block`` routed steps of the model under ``wrapper`` (DDP, or FSDP2 on every block and the
    root) with the audit (auditing ``steps``; None: every step) against ``block`` plain ones."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from wrapperroute import route_loss
    from wrapperroute.audit import Audit

    config = bench_ranks.SIZES[size]
    inner = bench_ranks.build_model(config)
    if wrapper == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block_module in inner.blocks:
            fully_shard(block_module)
        model: Any = fully_shard(inner)
    else:
        model = DDP(inner)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(torch.distributed.get_rank())
    ids = torch.randint(0, config.vocab, (4, config.seq), generator=generator)
    labels = torch.roll(ids, -1, 1)

    def step() -> None:
        route_loss(model, inner, bench_ranks.fused_ce, inner, ids, labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def plain() -> None:
        for _ in range(block):
            step()

    side = torch.distributed.new_group(backend="gloo")  # made once per run by the audit itself
    in_hook: list[float] = []  # seconds spent inside the audit's step hooks, per audited block

    def timed(audit: Audit) -> Audit:
        """``audit`` with its two step hooks timed: the audit's own share of a step, free of the step's noise
        (the wait for the exchange included: before the step, and what is left of it after the step)."""
        for name in ("_before_step", "_after_step"):
            hook = getattr(audit, name)

            def clocked(*args: Any, hook: Any = hook) -> None:
                start = time.perf_counter()
                hook(*args)
                in_hook[-1] += time.perf_counter() - start

            setattr(audit, name, clocked)
        return audit

    every = timed(Audit(None, "warn", None, group=side))  # one audit for the whole run: one scan

    def audited() -> None:
        # every step: the run's audit, paused between blocks; default: a fresh audit per block, so each block
        # pays what a run pays once (the scan of the process's objects, the first `steps` steps audited)
        audit = every if steps is None else timed(Audit(steps, "warn", None, group=side))
        in_hook.append(0.0)
        audit.install()
        try:
            for _ in range(block):
                step()
        finally:
            audit.uninstall()

    result = bench_ranks._paired(audited, plain, reps)
    result["params"] = bench_ranks.params_of(inner)
    measured = sorted(in_hook[-reps:])  # the warm-up blocks are not counted
    # The hook's median share of a plain block: what the audit adds, read from the hook itself.
    result["hook_share"] = measured[len(measured) // 2] / (result["median_b_ms"] / 1e3)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--wrapper", choices=["ddp", "fsdp2"], default="ddp")
    args = parser.parse_args()
    # every step: blocks of PARAMS_EVERY steps (one cycle of the audit's parameter comparisons), many of them
    size, reps = ("tiny", 3) if args.quick else ("10M", 41)
    started = time.perf_counter()
    with RankPool(2) as pool:
        every = pool.run(audited_step_ratio, size, reps, None, PARAMS_EVERY, args.wrapper, timeout=1800)[0]
        default = pool.run(audited_step_ratio, size, max(3, reps // 6), 3, 20 if args.quick else 100, args.wrapper,
                           timeout=1800)[0]  # fmt: skip
    print(json.dumps({"size": size, "wrapper": args.wrapper, "every_step": every, "default_steps": default}, indent=1))
    print(
        f"audited / plain step, {every['params'] / 1e6:.1f}M-parameter {args.wrapper} model, 2 CPU ranks, "
        f"medians of interleaved repetitions ({time.perf_counter() - started:.0f} s):\n"
        f"  every step audited (--steps all): {every['ratio']:.3f} [p10 {every['ratio_p10']:.3f}, "
        f"p90 {every['ratio_p90']:.3f}]; the audit's hooks: {every['hook_share']:.3f} of a plain step\n"
        f"  default (--steps 3) over 100 steps: {default['ratio']:.3f} [p10 {default['ratio_p10']:.3f}, "
        f"p90 {default['ratio_p90']:.3f}]; the audit's hooks: {default['hook_share']:.3f} of a plain step"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
