"""Run every benchmark on 2 CPU gloo ranks; print one table and write JSON to benchmarks/results/.

    python3 benchmarks/run.py            # full run (~5 minutes on 2 CPU cores)
    python3 benchmarks/run.py --quick    # a smoke run: few repetitions, small models only

Every figure is a ratio of two paths measured side by side in the same processes, repetitions interleaved
(the order alternates), with the median and the 10th-90th percentile spread of the per-repetition ratios.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import platform
import statistics
import sys
import time
import timeit
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the rank workers import bench_ranks from here

import bench_ranks  # noqa: E402
import torch  # noqa: E402

from wrapperroute import route_loss  # noqa: E402
from wrapperroute.check.console import say_stale_locks  # noqa: E402
from wrapperroute.check.extensions import cache_env  # noqa: E402
from wrapperroute.ranks import RankPool  # noqa: E402


def single_process_overhead(number: int = 200_000) -> dict[str, Any]:
    """route_loss on a plain module (no wrapper) vs calling fn: the price of the check itself."""
    model = torch.nn.Linear(2, 2)

    def fn() -> int:
        return 1

    route_loss(model, model, fn)  # let detect() learn the type
    direct = min(timeit.repeat(fn, number=number, repeat=7)) / number
    routed = min(timeit.repeat(lambda: route_loss(model, model, fn), number=number, repeat=7)) / number
    return {"direct_us": direct * 1e6, "route_loss_us": routed * 1e6, "overhead_us": (routed - direct) * 1e6}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repetitions, small models: a smoke run")
    parser.add_argument("--out", default=str(HERE / "results"), help="folder for the JSON (default: results/)")
    args = parser.parse_args()
    # The CLI's caches (inductor, DeepSpeed's C++ build): shared with `wrapperroute check`, inherited by the ranks.
    os.environ.update(cache_env())
    say_stale_locks(dict(os.environ))
    reps = 5 if args.quick else 31
    has_liger = importlib.util.find_spec("liger_kernel") is not None
    results: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}",
        "torch": torch.__version__,
        "command": "python3 benchmarks/run.py" + (" --quick" if args.quick else ""),
        "ranks": 2,
    }
    started = time.perf_counter()
    results["overhead_no_wrapper"] = single_process_overhead(20_000 if args.quick else 200_000)
    sizes = ["tiny"] if args.quick else list(bench_ranks.SIZES)
    with RankPool(2) as pool:
        results["ddp_step"] = {size: pool.run(bench_ranks.ddp_step_ratio, size, reps)[0] for size in sizes}
        results["ddp_call_overhead"] = pool.run(bench_ranks.call_overhead, max(3, reps // 3))[0]
        results["guard"] = {size: pool.run(bench_ranks.guard_overhead, size, reps)[0] for size in sizes}
        results["allocated"] = pool.run(bench_ranks.allocated_in_step, sizes[-1], max(5, reps // 3))[0]
        if has_liger:
            results["fallback"] = pool.run(bench_ranks.fallback_ratio, max(5, reps // 2), timeout=900)[0]
        if not args.quick:
            results["fsdp2_lm_head_group"] = pool.run(bench_ranks.fsdp2_alternatives, reps)[0]
            if importlib.util.find_spec("deepspeed") is not None:
                results["zero3"] = pool.run(bench_ranks.zero3_alternatives, reps, timeout=900)[0]
    # Peak RSS is a process-wide high-water mark: one fresh pool per measurement, paths alternating, and the
    # difference of the per-path medians (allocator and import noise is a few MiB either way).
    peaks: dict[str, list[float]] = {"native": [], "routed": []}
    for index in range(1 if args.quick else 5):
        for path in ("native", "routed") if index % 2 == 0 else ("routed", "native"):
            with RankPool(2) as pool:
                ranks = pool.run(bench_ranks.peak_rss, path, sizes[-1], 20)
            peaks[path].append(max(r["peak_rss_mib"] for r in ranks))
    memory: dict[str, Any] = {path: statistics.median(values) for path, values in peaks.items()}
    memory["runs"] = peaks
    memory["routed_minus_native_mib"] = memory["routed"] - memory["native"]
    memory["spread_mib"] = [min(peaks["routed"]) - max(peaks["native"]), max(peaks["routed"]) - min(peaks["native"])]
    results["peak_rss"] = memory
    results["seconds"] = round(time.perf_counter() - started, 1)

    print(format_table(results))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "quick.json" if args.quick else "latest.json"
    (out / name).write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {out / name}")
    return 0


def format_table(r: dict[str, Any]) -> str:
    def ratio(row: dict[str, Any]) -> str:
        return f"{row['ratio']:.3f}  [{row['ratio_p10']:.3f}-{row['ratio_p90']:.3f}]"

    lines = [f"{r['machine']}; torch {r['torch']}; {r['ranks']} gloo ranks; `{r['command']}`", ""]
    lines.append(f"{'measure':<58} {'median ratio [p10-p90]':<26} {'target':<10} absolute")
    for size, row in r["ddp_step"].items():
        label = f"routed / native DDP step, {size} ({row['params']:,} params)"
        lines.append(
            f"{label:<58} {ratio(row):<26} {'<= 1.01':<10} {row['median_a_ms']:.2f} vs {row['median_b_ms']:.2f} ms"
        )
    for size, row in r.get("guard", {}).items():
        label = f"guarded / unguarded routed DDP step, {size}"
        lines.append(f"{label:<58} {ratio(row):<26} {'-':<10} {row['median_a_ms']:.2f} vs {row['median_b_ms']:.2f} ms")
    if "fallback" in r:
        fb = r["fallback"]
        lines.append(
            f"{'Liger DPO: fallback (isolate) / plain redirect, warm':<58} {ratio(fb['isolate_vs_redirect']):<26} "
            f"{'<= 1.03':<10} {fb['isolate_vs_redirect']['median_a_ms']:.1f} ms"
        )
        lines.append(
            f"{'Liger DPO: fallback / compiled=False (the alternative)':<58} "
            f"{ratio(fb['isolate_vs_uncompiled']):<26} {'-':<10} "
            f"{fb['isolate_vs_uncompiled']['median_b_ms']:.1f} ms uncompiled"
        )
    o = r["overhead_no_wrapper"]
    lines.append(
        f"{'route_loss overhead, no wrapper (us per call)':<58} {o['overhead_us']:<26.3f} {'<= 2 us':<10} "
        f"{o['route_loss_us']:.3f} vs {o['direct_us']:.3f} us"
    )
    for label, row in r["ddp_call_overhead"].items():
        if "ours_over_trl" in row:
            spread = ratio({**row, "ratio": row["ours_over_trl"]})
            name = f"DDP routing per call, ours / TRL, {label} params"
            lines.append(f"{name:<58} {spread:<26} {'<= 1':<10} {row['ours_us']:.1f} vs {row['trl_us']:.1f} us")
            if "bare_over_trl" in row:
                bare = {"ratio": row["bare_over_trl"], "ratio_p10": row["bare_p10"], "ratio_p90": row["bare_p90"]}
                spread = ratio(bare)
                name = f"  decomposition: bare swap, no checks / TRL, {label}"
                lines.append(f"{name:<58} {spread:<26} {'-':<10} {row['bare_us']:.1f} vs TRL {row['trl_us']:.1f} us")
        else:
            lines.append(f"{'DDP routing per call, ' + label + ' params (us)':<58} {row['ours_us']:<26.1f}")
    if "fsdp2_lm_head_group" in r:
        f2 = r["fsdp2_lm_head_group"]
        lines.append(
            f"{'FSDP2 lm_head group: routed / full_tensor() gather':<58} {ratio(f2):<26} {'-':<10} "
            f"max|grad-ref|: routed {f2['routed_max_ref_diff']:.1g}, full_tensor {f2['alternative_max_ref_diff']:.1g}"
        )
    if "zero3" in r:
        z3 = r["zero3"]
        gathered = z3["alternative_max_ref_diff"]
        gathered = gathered if isinstance(gathered, str) else f"{gathered:.1g}"
        found = f"max|grad-ref|: routed {z3['routed_max_ref_diff']:.1g}, gathered {gathered}"
        timed = ratio(z3) if "ratio" in z3 else "not timed: the gather fails"
        lines.append(f"{'ZeRO-3: routed / GatheredParameters(all) gather':<58} {timed:<26} {'-':<10} {found}")
    m = r["peak_rss"]
    a = r["allocated"]
    if "error" not in a:
        lines.append(
            f"{'malloc bytes held after forward, routed - native (KiB)':<58} "
            f"{a['forward_routed_minus_native_kib']:<26.1f} {'<= 1024':<10} "
            f"of {a['forward_native_mib']:.1f} MiB; after backward {a['backward_routed_minus_native_kib']:.1f} KiB"
        )
    low, high = m["spread_mib"]
    lines.append(
        f"{'peak RSS per rank, routed - native (MiB), medians of ' + str(len(m['runs']['routed'])):<58} "
        f"{m['routed_minus_native_mib']:.2f}  [{low:.2f} to {high:.2f}]{'':<7} {'<= 1 MiB':<10} "
        f"{m['routed']:.1f} vs {m['native']:.1f} MiB"
    )
    lines.append(f"\ntotal {r['seconds']} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
