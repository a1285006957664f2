"""What ``token_divisor`` costs a training step: an optimizer step of a routed DDP model over
``token_divisor(model, count)`` against the same step over the rank's own count, and against the same step over
a bare all-reduce of the same two numbers (what any global count costs), same run, repetitions interleaved; for
a step of two micro-batches (accumulation, one call per optimizer step) and of one.

    python3 benchmarks/token_cost.py            # ~10M-parameter DDP model, 2 CPU ranks (~10 minutes)
    python3 benchmarks/token_cost.py --quick    # a smoke run

The ratio is the median of the per-repetition ratios, with their 10th and 90th percentiles; beside it, the time
spent inside ``token_divisor`` itself (the median call, as a share of the step without it), which the step's
own noise does not blur.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import bench_ranks  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from wrapperroute import route_loss  # noqa: E402
from wrapperroute.ranks import RankPool  # noqa: E402


def token_divisor_ratio(size: str, reps: int, micro_batches: int) -> dict[str, Any]:
    """An optimizer step of a routed DDP model, ``micro_batches`` forward+backward passes of a summed loss (all but
    the last under ``no_sync``) then SGD, over ``token_divisor`` (the step's count all-reduced, once, at the step's
    start as docs/normalisation.md writes it) / the same step over this rank's own count (no collective), and /
    the same step over a bare all-reduce of the same two numbers."""
    from wrapperroute import token_divisor

    config = bench_ranks.SIZES[size]
    generator = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, config.vocab, (4, config.seq), generator=generator)
    labels = torch.roll(ids, -1, 1)
    labels[:, : 3 + dist.get_rank()] = -100  # a different count on each rank
    count = micro_batches * int((labels != -100).sum())
    lm = bench_ranks.build_model(config)
    model = DDP(lm)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def summed(inner: Any) -> torch.Tensor:
        logits = inner(ids) @ inner.lm_head.weight.t()
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")

    def step(divisor: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            over = divisor()
            for index in range(micro_batches):
                last = index == micro_batches - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    (route_loss(model, lm, summed, lm) / over).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return run

    spent: list[float] = []  # seconds inside token_divisor, per call: its own share of a step, free of noise

    def timed_divisor() -> Any:
        start = time.perf_counter()
        value = token_divisor(model, count)
        spent.append(time.perf_counter() - start)
        return value

    def bare_all_reduce() -> torch.Tensor:
        """The one collective any global count needs, and nothing else: what the machine charges for it."""
        sent = torch.tensor([float(count), 0.0], dtype=torch.float64)
        dist.all_reduce(sent)
        return torch.tensor(sent.tolist()[0] / dist.get_world_size())

    per_rep = bench_ranks._steps_per_rep(lm)
    with_divisor = bench_ranks._repeated(step(timed_divisor), per_rep)
    own_count = bench_ranks._repeated(step(lambda: torch.tensor(float(count))), per_rep)
    bare = bench_ranks._repeated(step(bare_all_reduce), per_rep)
    timed = bench_ranks._paired(with_divisor, own_count, reps)
    call = sorted(spent)[len(spent) // 2]
    share = call * per_rep / (timed["median_b_ms"] / 1e3)
    return {"params": bench_ranks.params_of(lm), "micro_batches": micro_batches, "steps_per_rep": per_rep,
            "call_us": call * 1e6, "call_share": share, **timed,
            "bare_over_own": bench_ranks._paired(bare, own_count, reps),
            "over_bare": bench_ranks._paired(with_divisor, bare, reps)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=401, help="interleaved repetitions (default 401)")
    args = parser.parse_args()
    size, reps = ("tiny", 5) if args.quick else ("10M", args.reps)
    rows = []
    with RankPool(2) as pool:
        for micro_batches in (2, 1):
            started = time.perf_counter()
            row = pool.run(token_divisor_ratio, size, reps, micro_batches, timeout=3600)[0]
            rows.append(row)
            print(json.dumps({"size": size, **row}, indent=1))
            print(_line(row, time.perf_counter() - started))
    print("\n".join(_line(row) for row in rows))
    return 0


def _line(row: dict[str, Any], seconds: float | None = None) -> str:
    took = f", {seconds:.0f} s" if seconds is not None else ""
    bare, alone = row["over_bare"], row["bare_over_own"]
    return (
        f"{row['micro_batches']} micro-batch(es) a step, {row['params'] / 1e6:.1f}M-parameter DDP model, 2 CPU ranks"
        f"{took}: step over token_divisor / over the rank's own count {row['ratio']:.3f} [p10 {row['ratio_p10']:.3f}"
        f", p90 {row['ratio_p90']:.3f}] ({row['median_a_ms']:.1f} vs {row['median_b_ms']:.1f} ms; the call "
        f"{row['call_us']:.0f} us, {row['call_share']:.4f} of a step); a bare all-reduce of the same two numbers / "
        f"the own count {alone['ratio']:.3f} [{alone['ratio_p10']:.3f}, {alone['ratio_p90']:.3f}]; token_divisor / "
        f"the bare all-reduce {bare['ratio']:.3f} [{bare['ratio_p10']:.3f}, {bare['ratio_p90']:.3f}]"
    )


if __name__ == "__main__":
    sys.exit(main())
