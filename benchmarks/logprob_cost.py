"""Log-probabilities and entropy, forward and backward, ours against TRL's ``ChunkedLogProbFunction`` (TRL >= 1.16;
its torch path on CPU), fp32, the same run:

- ``--tp 1`` (one process): ``wrapperroute.losses.linear_logprobs(..., return_entropy=True)`` against TRL's
  function with the vocabulary tile its fused LM head uses (``_CHUNKED_LOGPROB_CHUNK_SIZE``, 32768);
- ``--tp 2`` / ``--tp 4`` (CPU gloo ranks, the head a DTensor sharded on the vocabulary): ours on the shard
  against TRL's ``fused_lm_head`` path, which calls ``weight.full_tensor()`` on a DTensor head and then the same
  function on the whole head;
- the targets' check (``check_targets``: one pass, one reduction, two numbers read on the host) against the
  forward alone, at the same sizes.

Figures: peak bytes the CPU allocator held during forward and backward (torch's profiler's allocation events:
every allocation and free of a tensor, no sampling; rank 0), and of those, the peak of the head-sized ones (whole
head, or a shard, or their gradients: allocations of exactly those sizes; ours counted with one row fewer per
chunk, so that no chunk of logits has a shard's size); time,
repetitions interleaved (order alternating), the median of the per-repetition ratios ours / TRL's with the
10th-90th percentile spread; and how far ours is from TRL's (values and gradients).

    python3 benchmarks/logprob_cost.py                 # one process: vocabulary 32768, hidden 512, 2048 tokens
    python3 benchmarks/logprob_cost.py --tp 2          # and --tp 4
    python3 benchmarks/logprob_cost.py --quick         # small sizes, few repetitions: a smoke run
    python3 benchmarks/logprob_cost.py --tp 2 --fields all   # every field TRL's fused head computes, both sides

``--fields all``: both sides compute the five per-token fields TRL's fused LM head can return (log-probabilities,
entropy, ``log_sum_sq_probs``, ``mean_logits``, ``is_top1``; DPO asks for four of them), ours through
``linear_logprobs(..., outputs=...)``, what ``patch_trl()`` runs on a head split on the vocabulary.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from wrapperroute.losses import linear_logprobs  # noqa: E402
from wrapperroute.losses._layout import check_targets  # noqa: E402
from wrapperroute.losses._rows import chunk_rows  # noqa: E402
from wrapperroute.ranks import RankPool  # noqa: E402


def allocations(run: Callable[[], Any]) -> list[int]:
    """Every allocation (positive) and free (negative) of the CPU allocator while ``run`` ran, in order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = prof.profiler.kineto_results.events()  # type: ignore[union-attr]
    return [change for _, change in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")]


def peak(changes: list[int], sizes: set[int] | None = None) -> int:
    """The most bytes held at once (above what was held before), counting only allocations of ``sizes``."""
    held = top = 0
    for change in changes:
        if sizes is None or abs(change) in sizes:
            held += change
            top = max(top, held)
    return top


def _trl_tile() -> int:
    try:
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

        return int(_CHUNKED_LOGPROB_CHUNK_SIZE)
    except ImportError:
        return 32768


def _spread(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "p10": ordered[len(ordered) // 10],
            "p90": ordered[-1 - len(ordered) // 10]}  # fmt: skip


def _paired(ours: Callable[[], Any], theirs: Callable[[], Any], reps: int, sync: bool) -> dict[str, Any]:
    """Ours and theirs timed in turn, the order alternating every repetition."""
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    for rep in range(reps):
        order = [("ours", ours), ("theirs", theirs)]
        for name, run in order if rep % 2 == 0 else reversed(order):
            if sync:
                dist.barrier()
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {"ratio": _spread([o / t for o, t in zip(times["ours"], times["theirs"], strict=True)]),
            "median_seconds": {name: statistics.median(values) for name, values in times.items()}}  # fmt: skip


EVERY_FIELD = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def measure(vocab: int, hidden_size: int, tokens: int, reps: int, every_field: bool = False) -> dict[str, Any]:
    """On every rank (or the one process): both paths' memory, time and agreement."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    ranks = dist.get_world_size() if dist.is_initialized() else 1
    generator = torch.Generator().manual_seed(0)
    whole = torch.randn(vocab, hidden_size, generator=generator) * 0.02
    hidden = torch.randn(tokens, hidden_size, generator=generator).requires_grad_()
    target = torch.randint(0, vocab, (tokens,), generator=generator)
    incoming = torch.randn(2, tokens, generator=generator)
    weight: Any = whole.requires_grad_()
    if ranks > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (ranks,), mesh_dim_names=("tp",))
        weight = distribute_tensor(whole.detach(), mesh, [Shard(0)]).requires_grad_()
    tile = _trl_tile()

    fields = EVERY_FIELD if every_field else ("entropy",)

    def ours(chunk: int | None = None) -> list[torch.Tensor]:
        if not every_field:
            return list(linear_logprobs(hidden, weight, target, return_entropy=True, chunk_size=chunk))
        found = linear_logprobs(hidden, weight, target, outputs=fields, chunk_size=chunk)
        return [found["log_probs"], found["entropy"]]

    def theirs() -> list[torch.Tensor]:
        head = weight.full_tensor() if ranks > 1 else weight  # what TRL's fused_lm_head does with a DTensor head
        return list(ChunkedLogProbFunction.apply(hidden, head, None, target, 1.0, tile, None, 1.0, fields)[:2])

    def step(path: Callable[[], list[torch.Tensor]]) -> Callable[[], None]:
        def run() -> None:
            logprobs, entropy = path()
            (logprobs * incoming[0] + entropy * incoming[1]).sum().backward()
            hidden.grad = weight.grad = None

        return run

    found = {}
    for name, path in (("ours", ours), ("theirs", theirs)):
        logprobs, entropy = path()
        grads = torch.autograd.grad((logprobs * incoming[0] + entropy * incoming[1]).sum(), [hidden, weight])
        found[name] = [logprobs.detach(), entropy.detach(), *(g.to_local() if hasattr(g, "to_local") else g
                                                              for g in grads)]  # fmt: skip
    names = ("logprobs", "entropy", "hidden.grad", "weight.grad")
    agreement = {n: float((a - b).abs().max()) for n, a, b in zip(names, found["ours"], found["theirs"], strict=True)}
    for run in (step(ours), step(theirs)):  # warm-up
        run()
    element = whole.element_size()
    head_sizes = {vocab * hidden_size * element, -(-vocab // ranks) * hidden_size * element}
    changes = {name: allocations(step(path)) for name, path in (("ours", ours), ("theirs", theirs))}
    # the head-sized count of ours, again with one row fewer per chunk: a default chunk of logits can be exactly a
    # shard's size (32 MiB at tp=2), and what ours allocates of the head's size does not depend on the chunk
    rows = chunk_rows(tokens, hidden_size, -(-vocab // ranks), None, per_token=True)
    head_changes = {"ours": allocations(step(functools.partial(ours, max(1, rows - 1)))), "theirs": changes["theirs"]}
    timed = _paired(step(ours), step(theirs), reps, ranks > 1)
    forward = lambda: linear_logprobs(hidden.detach(), whole.detach(), target, return_entropy=True)  # noqa: E731
    check = _paired(lambda: check_targets(target, vocab, -100), forward, reps, False) if ranks == 1 else None
    return {"peak_bytes": {name: peak(c) for name, c in changes.items()},
            "head_peak_bytes": {name: peak(c, head_sizes) for name, c in head_changes.items()},
            "time": timed, "agreement": agreement, "check_over_forward": check, "trl_tile": tile}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, help="repetitions (default 21 on one process, 7 on ranks)")
    every = "log-probabilities with the entropy (default), or every field of TRL's fused head"
    parser.add_argument("--fields", choices=("entropy", "all"), default="entropy", help=every)
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args()
    vocab, hidden_size, tokens = (4096, 128, 256) if args.quick else (32768, 512, 2048)
    reps = args.reps or (3 if args.quick else 21 if args.tp == 1 else 7)
    if args.tp == 1:
        torch.manual_seed(0)
        found = measure(vocab, hidden_size, tokens, reps, args.fields == "all")
    else:
        with RankPool(args.tp) as pool:
            found = pool.run(measure, vocab, hidden_size, tokens, reps, args.fields == "all", timeout=3000)[0]
    import trl

    command = "python3 benchmarks/logprob_cost.py" + (f" --tp {args.tp}" if args.tp != 1 else "") + (
        " --quick" if args.quick else "") + (" --fields all" if args.fields == "all" else "")  # fmt: skip
    report = {"command": command, "tp": args.tp, "vocab": vocab, "hidden": hidden_size, "tokens": tokens,
              "reps": reps, "torch": torch.__version__, "trl": trl.__version__, **found}  # fmt: skip
    mib = {
        side: {k: v / 2**20 for k, v in found[key].items()}
        for side, key in (("all", "peak_bytes"), ("head", "head_peak_bytes"))
    }
    ratio = found["time"]["ratio"]
    what = "every field of the fused head" if args.fields == "all" else "log-probabilities + entropy"
    print(f"tp={args.tp}, vocabulary {vocab}, hidden {hidden_size}, {tokens} tokens, fp32, {what} forward and "
          f"backward; TRL {trl.__version__}, vocabulary tile {found['trl_tile']}")  # fmt: skip
    print(f"peak MiB: ours {mib['all']['ours']:.1f}, TRL's {mib['all']['theirs']:.1f} "
          f"({found['peak_bytes']['ours'] / found['peak_bytes']['theirs']:.3f})")  # fmt: skip
    print(f"head-sized peak MiB: ours {mib['head']['ours']:.1f}, TRL's {mib['head']['theirs']:.1f} "
          f"({found['head_peak_bytes']['ours'] / max(found['head_peak_bytes']['theirs'], 1):.3f})")  # fmt: skip
    print(
        f"time ours / TRL's: {ratio['median']:.3f} ({ratio['p10']:.3f}-{ratio['p90']:.3f}); medians "
        f"{found['time']['median_seconds']['ours']:.3f} s / {found['time']['median_seconds']['theirs']:.3f} s"
    )
    print("largest difference from TRL's: " + ", ".join(f"{k} {v:.2e}" for k, v in found["agreement"].items()))
    if found["check_over_forward"] is not None:
        check = found["check_over_forward"]["ratio"]
        print(f"targets' check / forward: {check['median']:.2e} ({check['p10']:.2e}-{check['p90']:.2e})")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"logprob_cost_tp{args.tp}{'_all' if args.fields == 'all' else ''}{'_quick' if args.quick else ''}.json"
    (out / name).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
