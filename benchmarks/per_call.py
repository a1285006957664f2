"""Per-call cost of a routed DDP call, across source trees: the same-run ratio of two versions of wrapperroute,
and the gap to TRL's ``_ForwardRedirection``.

    python3 benchmarks/per_call.py TREE_A TREE_B [--rounds 7]

Each round runs one fresh process per tree, alternating the order; a process times blocks of 2,000 calls of
``route_loss(ddp, model, trivial, x)`` under ``torch.no_grad()`` (one gloo rank, a 1e6-parameter model) and of
TRL's redirection on a twin model, and prints the best block of each. Reported: the median over rounds of each
tree's per-call time, and of its ratio to TRL's measured in the same process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CALLS = 2000

CHILD = r"""
import functools, json, os, sys, tempfile, time
import torch, torch.distributed as dist
torch.set_num_threads(1)
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
from torch.nn.parallel import DistributedDataParallel as DDP
from wrapperroute import route_loss
from wrapperroute.check.models import TinyConfig, build_model
config = TinyConfig(vocab=4096, hidden=128, layers=2)
model, twin = build_model(config), build_model(config)
ddp, twin_ddp = DDP(model), DDP(twin)
x = torch.ones(())
def trivial(t):
    return t
ours = functools.partial(route_loss, ddp, model, trivial, x)
try:
    from trl.models.utils import _ForwardRedirection
    theirs = functools.partial(_ForwardRedirection(), twin_ddp, twin, trivial, x)
except ImportError:
    theirs = None
def block(call):
    start = time.perf_counter()
    for _ in range(%(calls)d):
        call()
    return (time.perf_counter() - start) / %(calls)d * 1e6
with torch.no_grad():
    for _ in range(3):
        block(ours)
    best_ours, best_trl = [], []
    for _ in range(9):
        best_ours.append(block(ours))
        if theirs is not None:
            best_trl.append(block(theirs))
print(json.dumps({"ours_us": min(best_ours), "trl_us": min(best_trl) if best_trl else None}))
"""


def run(tree: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    done = subprocess.run([sys.executable, "-c", CHILD % {"calls": CALLS}], env=env, cwd=tree, capture_output=True,
                          text=True, timeout=600, check=True)  # fmt: skip
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="+", help="source trees (folders holding a wrapperroute package)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    times: dict[str, list[float]] = {tree: [] for tree in args.trees}
    over_trl: dict[str, list[float]] = {tree: [] for tree in args.trees}
    for index in range(args.rounds):
        order = args.trees if index % 2 == 0 else list(reversed(args.trees))
        for tree in order:
            result = run(tree)
            times[tree].append(result["ours_us"])
            if result["trl_us"]:
                over_trl[tree].append(result["ours_us"] / result["trl_us"])
    first = args.trees[0]
    for tree in args.trees:
        median = statistics.median(times[tree])
        line = f"{tree}: {median:.2f} us per call, {median / statistics.median(times[first]):.3f} x {first}"
        if over_trl[tree]:
            line += f", ours/TRL {statistics.median(over_trl[tree]):.3f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
