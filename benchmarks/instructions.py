"""Instructions per routed DDP call, ours vs TRL's ``_ForwardRedirection``, counted by valgrind's cachegrind.

    python3 benchmarks/instructions.py      # ~10 minutes on one core: four runs under valgrind

Wall time per call (``run.py``) is noisy and, on some machines, not proportional to the work done; an
instruction count is exact and repeatable. Each path runs ``LOW`` and ``HIGH`` calls in its own process under
cachegrind; the difference of the two totals over ``HIGH - LOW`` is the cost of one call (DDP's own forward
included, start-up excluded). Needs ``valgrind`` on PATH and TRL installed.

The worker (``--worker ours|trl N``) is this file run by a one-rank gloo group on CPU, with no gradient
recorded: a trivial loss, so only the routing and DDP's forward bookkeeping count.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import types
from typing import Any

LOW, HIGH = 200, 10_200


def worker(path: str, calls: int, bytecodes: bool = False) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29_000 + os.getpid() % 1000))
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from wrapperroute import route_loss

    dist.init_process_group("gloo", rank=0, world_size=1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    ddp = DistributedDataParallel(model)
    x = torch.ones(())

    def trivial(t: torch.Tensor) -> torch.Tensor:
        return t

    if path == "ours":
        call = lambda: route_loss(ddp, model, trivial, x)  # noqa: E731
    else:
        from trl.models.utils import _ForwardRedirection

        redirect = _ForwardRedirection()
        call = lambda: redirect(ddp, model, trivial, x)  # noqa: E731
    with torch.no_grad():
        for _ in range(calls):
            result = call()
        if bytecodes:
            print(f"bytecodes: {_bytecodes(call)}")
    assert calls == 0 or result is x, "the trivial loss's result did not come back through DDP"
    dist.destroy_process_group()
    print(f"{path}: {calls} calls")


def _bytecodes(call: Any) -> int:
    """Python bytecodes one call executes, every frame counted (DDP's forward and torch's included)."""
    count = 0

    def trace(frame: types.FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        was, frame.f_trace_opcodes = frame.f_trace_opcodes, True
        if not was and sys.version_info[:2] == (3, 12):  # 3.12 ignores the flag set in an event until settrace
            sys.settrace(trace)
        count += event == "opcode"
        return trace

    sys.settrace(trace)
    try:
        call()
    finally:
        sys.settrace(None)
    return count


def instructions(path: str, calls: int, folder: pathlib.Path) -> int:
    out = folder / f"{path}.{calls}.cg"
    command = [
        "valgrind", "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={out}",
        sys.executable, __file__, "--worker", path, str(calls),
    ]  # fmt: skip
    # Start-up differs by a few million instructions between runs (and by far more when threads spin-wait on a
    # busy machine): one intra-op thread, fixed hashing, and 10,000 calls between the two counts keep that
    # under a few hundred instructions per call. Run it on an otherwise idle machine.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if found is None:
        raise RuntimeError(f"no instruction count in valgrind's output:\n{done.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def bytecodes(path: str) -> int:
    """Python bytecodes per call (no valgrind): the interpreter's dispatch, which wall time follows."""
    command = [sys.executable, __file__, "--worker", path, "50", "--bytecodes"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    found = re.search(r"bytecodes: (\d+)", done.stdout)
    if found is None:
        raise RuntimeError(f"no bytecode count in the worker's output:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return int(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs=2, metavar=("PATH", "CALLS"), help=argparse.SUPPRESS)
    parser.add_argument("--bytecodes", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "instructions.json"))
    args = parser.parse_args()
    if args.worker:
        worker(args.worker[0], int(args.worker[1]), args.bytecodes)
        return 0
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    result: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as folder:
        for path in ("ours", "trl"):
            low, high = (instructions(path, n, pathlib.Path(folder)) for n in (LOW, HIGH))
            result[f"{path}_instructions_per_call"] = (high - low) / (HIGH - LOW)
            result[f"{path}_bytecodes_per_call"] = bytecodes(path)
    result["ours_over_trl"] = result["ours_instructions_per_call"] / result["trl_instructions_per_call"]
    result["bytecodes_ours_over_trl"] = result["ours_bytecodes_per_call"] / result["trl_bytecodes_per_call"]
    pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for key, value in result.items():
        print(f"{key:<32} {value:,.3f}" if "over" in key else f"{key:<32} {value:,.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
