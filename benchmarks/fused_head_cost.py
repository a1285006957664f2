"""TRL's fused LM head (``add_fused_lm_head``, TRL >= 1.16) as ``patch_trl()`` leaves it against TRL's own, a whole
training forward and backward of a small Llama, fp32, the same run, repetitions interleaved (order alternating):

- ``--tp 1`` (one process, a plain head): the patched forward is TRL's own behind one look at the head (its
  FSDP2 unit, whether it is split on the vocabulary); the ratio is that look's cost;
- ``--tp 2`` (CPU gloo ranks, ``ColwiseParallel`` head): the patched forward computes the head from its shard,
  TRL's gathers it (``full_tensor()``).

Figures: time ratio patched / TRL's (median of per-repetition ratios, 10th-90th percentile), and the peak bytes
the CPU allocator held during one step (torch's profiler's allocation events; rank 0).

    python3 benchmarks/fused_head_cost.py            # one process
    python3 benchmarks/fused_head_cost.py --tp 2
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import sys
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from logprob_cost import _paired, allocations, peak  # noqa: E402

from wrapperroute.ranks import RankPool  # noqa: E402

FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def measure(vocab: int, hidden: int, tokens: int, reps: int) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer import utils

    from wrapperroute.integrations.trl import patch_trl, unpatch_trl

    ranks = dist.get_world_size() if dist.is_initialized() else 1
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=tokens)  # fmt: skip
    torch.manual_seed(0)
    theirs = LlamaForCausalLM(config)
    ours = copy.deepcopy(theirs)
    if ranks > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (ranks,), mesh_dim_names=("tp",))
        for model in (ours, theirs):
            parallelize_module(model, mesh, {"lm_head": ColwiseParallel(use_local_output=False)})
    utils.add_fused_lm_head(theirs, outputs=FIELDS)
    patch_trl()
    try:
        utils.add_fused_lm_head(ours, outputs=FIELDS)
    finally:
        unpatch_trl()
    ids = torch.randint(0, vocab, (2, tokens // 2), generator=torch.Generator().manual_seed(1))
    labels = ids.masked_fill(torch.arange(tokens // 2) < 16, -100)

    def step(model: Any) -> Any:
        def run() -> None:
            out = model(input_ids=ids, labels=labels, fused_lm_head=True)
            (out.loss + 0.1 * out.entropy.sum()).backward()
            model.zero_grad(set_to_none=True)

        return run

    for model in (ours, theirs):  # warm-up
        step(model)()
    memory = {name: peak(allocations(step(model))) for name, model in (("ours", ours), ("theirs", theirs))}
    timed = _paired(step(ours), step(theirs), reps, ranks > 1)
    return {"peak_bytes": memory, "time": timed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args()
    vocab, hidden, tokens = 32768, 512, 2048
    if args.tp == 1:
        found = measure(vocab, hidden, tokens, args.reps)
    else:
        with RankPool(args.tp) as pool:
            found = pool.run(measure, vocab, hidden, tokens, args.reps, timeout=3000)[0]
    import trl

    ratio = found["time"]["ratio"]
    memory = found["peak_bytes"]
    print(f"tp={args.tp}: TRL {trl.__version__}'s fused LM head, Llama vocabulary {vocab}, hidden {hidden}, {tokens} "
          "tokens, every field, fp32, forward and backward; patched / TRL's own")  # fmt: skip
    print(
        f"time: {ratio['median']:.3f} ({ratio['p10']:.3f}-{ratio['p90']:.3f}); medians "
        f"{found['time']['median_seconds']['ours']:.3f} s / {found['time']['median_seconds']['theirs']:.3f} s"
    )
    print(f"peak MiB: {memory['ours'] / 2**20:.1f} / {memory['theirs'] / 2**20:.1f} "
          f"({memory['ours'] / memory['theirs']:.3f})")  # fmt: skip
    report = {"command": "python3 benchmarks/fused_head_cost.py" + (f" --tp {args.tp}" if args.tp != 1 else ""),
              "tp": args.tp, "vocab": vocab, "hidden": hidden, "tokens": tokens, "reps": args.reps,
              "torch": torch.__version__, "trl": trl.__version__, **found}  # fmt: skip
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"fused_head_cost_tp{args.tp}.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
