"""A cross-entropy on a head sharded on the vocabulary, three ways, on ``--tp`` CPU gloo ranks, same run:

- ``ours``: ``wrapperroute.losses.linear_cross_entropy`` on the sharded head (chunked; nothing gathered);
- ``gathered``: the head gathered whole (``weight.full_tensor()``), then the same chunked loss on it: what a
  fused loss that does not know DTensors needs;
- ``loss_parallel``: the sharded logits materialised (``hidden @ local_weight.T`` as a ``DTensor``) and torch's
  ``loss_parallel`` cross-entropy, backward inside its context.

Figures: the peak bytes the CPU allocator holds during forward and backward on rank 0 (torch's profiler's
allocation events: exact for the allocator, no sampling), each beside ours; and time, repetitions interleaved,
the median of the per-repetition ratios ours / other, with the 10th-90th percentile spread.

    python3 benchmarks/tp_loss.py              # tp=2: vocabulary 32768, hidden 512, 1024 tokens
    python3 benchmarks/tp_loss.py --tp 4
    python3 benchmarks/tp_loss.py --quick      # small sizes, few repetitions: a smoke run
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from wrapperroute.losses import linear_cross_entropy  # noqa: E402
from wrapperroute.ranks import RankPool  # noqa: E402


def peak_bytes(run: Callable[[], Any]) -> int:
    """The most bytes the CPU allocator held at once while ``run`` ran, above what it held before."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        run()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    held = top = 0
    for _, change in events:
        held += change
        top = max(top, held)
    return top


def measure(vocab: int, hidden_size: int, tokens: int, reps: int, chunk: int | None = None) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    generator = torch.Generator().manual_seed(0)
    weight = distribute_tensor(torch.randn(vocab, hidden_size, generator=generator) * 0.02, mesh, [Shard(0)])
    weight.requires_grad_()
    hidden = torch.randn(tokens, hidden_size, generator=generator).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), generator=generator)

    def ours() -> None:
        linear_cross_entropy(hidden, weight, target, chunk_size=chunk).backward()

    def gathered() -> None:
        linear_cross_entropy(hidden, weight.full_tensor(), target, chunk_size=chunk).backward()

    def parallel() -> None:
        local = hidden @ weight.to_local().t()
        logits = DTensor.from_local(local, mesh, [Shard(1)], run_check=False)
        with loss_parallel():
            torch.nn.functional.cross_entropy(logits, target).backward()

    paths = {"ours": ours, "gathered": gathered, "loss_parallel": parallel}
    for run in paths.values():  # warm-up
        run()
    peaks = {name: peak_bytes(run) for name, run in paths.items()}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for rep in range(reps):
        order = list(paths) if rep % 2 == 0 else list(reversed(paths))
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            paths[name]()
            times[name].append(time.perf_counter() - start)
    shard = weight.to_local()
    return {"peaks": peaks, "times": times, "head_shard_bytes": shard.numel() * shard.element_size(),
            "logits_shard_bytes": tokens * shard.shape[0] * 4}  # fmt: skip


def _spread(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "p10": ordered[len(ordered) // 10],
            "p90": ordered[-1 - len(ordered) // 10]}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--chunk", type=int, help="rows per chunk (default: wrapperroute.losses' own choice)")
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args()
    vocab, hidden_size, tokens, reps = (4096, 128, 256, 5) if args.quick else (32768, 512, 1024, 21)
    with RankPool(args.tp) as pool:
        found = pool.run(measure, vocab, hidden_size, tokens, reps, args.chunk, timeout=1800)[0]
    peaks, times = found["peaks"], found["times"]
    ratios = {other: _spread([o / t for o, t in zip(times["ours"], times[other], strict=True)])
              for other in ("gathered", "loss_parallel")}  # fmt: skip
    report = {
        "command": "python3 benchmarks/tp_loss.py" + (f" --tp {args.tp}" if args.tp != 2 else "")
        + (" --quick" if args.quick else ""),
        "tp": args.tp, "vocab": vocab, "hidden": hidden_size, "tokens": tokens, "reps": reps,
        "torch": torch.__version__, "peak_bytes": peaks, "head_shard_bytes": found["head_shard_bytes"],
        "logits_shard_bytes": found["logits_shard_bytes"], "time_ratio_ours_over": ratios,
        "median_seconds": {name: statistics.median(values) for name, values in times.items()},
    }  # fmt: skip
    print(f"tp={args.tp}, vocabulary {vocab}, hidden {hidden_size}, {tokens} tokens, fp32, rank 0 of {args.tp}")
    print(f"{'path':<14} {'peak MiB':>9} {'ours / it':>10} {'time ours / it (p10-p90)':>28}")
    for name in ("ours", "gathered", "loss_parallel"):
        mib = peaks[name] / 2**20
        if name == "ours":
            print(f"{name:<14} {mib:>9.1f} {'':>10} {'':>28}")
            continue
        spread = ratios[name]
        figure = f"{spread['median']:.3f} ({spread['p10']:.3f}-{spread['p90']:.3f})"
        print(f"{name:<14} {mib:>9.1f} {peaks['ours'] / peaks[name]:>10.3f} {figure:>28}")
    shard, logits = found["head_shard_bytes"] / 2**20, found["logits_shard_bytes"] / 2**20
    print(f"head shard {shard:.1f} MiB, sharded logits {logits:.1f} MiB")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"tp_loss_tp{args.tp}{'_quick' if args.quick else ''}.json"
    (out / name).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
