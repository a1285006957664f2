"""What ``PipelineLoss`` costs a pipeline step: routed / bare, same run, interleaved.

    python3 benchmarks/pipeline_cost.py            # ~10M-parameter model, pp2 x dp2 on 4 CPU ranks (a few minutes)
    python3 benchmarks/pipeline_cost.py --quick    # a smoke run

Two pipelines of the same model on a (pp2, dp2) mesh, FSDP2 inside the stages with the head in the last stage's
root group (kept unsharded after the stage's forward, so the bare loss is exact there too), 1F1B, 4 micro-batches:
one whose ``loss_fn`` is ``PipelineLoss`` (each micro-batch's loss inside the stage's FSDP2 forward, over the step's
token divisor), one whose ``loss_fn`` is the same summed loss read after the stage's forward, over the same divisor.
Each repetition times a step of each, in alternating order; the ratio is the median of the per-repetition ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import bench_ranks  # noqa: E402

from wrapperroute.ranks import RankPool  # noqa: E402

MICRO = 4


def routed_over_bare(size: str, reps: int) -> dict[str, Any]:
    """On every rank of 4: a 1F1B step with ``PipelineLoss`` against the same step with the bare loss."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from wrapperroute import PipelineLoss
    from wrapperroute.check.models import stage_pieces

    config = bench_ranks.SIZES[size]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    coordinate, replica = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")

    def pipeline(routed: bool) -> tuple[Any, Any, Any]:
        piece = stage_pieces(bench_ranks.build_model(config), 2)[coordinate]
        for block in piece.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(piece, mesh=mesh["dp"])  # the head in the root's group, unsharded after the forward

        def summed(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            logits = output.flatten(0, 1) @ piece.lm_head.weight.t()  # type: ignore[union-attr]
            return F.cross_entropy(logits, target.flatten(), reduction="sum")

        stage = PipelineStage(piece, coordinate, 2, torch.device("cpu"), group=mesh["pp"].get_group())
        loss = PipelineLoss(stage, summed)

        def bare(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return summed(output, target) / loss.divisor  # type: ignore[operator]

        return piece, loss, Schedule1F1B(stage, n_microbatches=MICRO, loss_fn=loss if routed else bare,
                                         scale_grads=False)  # fmt: skip

    generator = torch.Generator().manual_seed(replica)
    ids = torch.randint(0, config.vocab, (2 * MICRO, config.seq), generator=generator)
    labels = torch.roll(ids, -1, 1)

    def step_of(piece: Any, loss: Any, schedule: Any) -> Any:
        def step() -> None:
            loss.begin_step(labels.numel(), schedule)
            schedule.step(*((ids,) if coordinate == 0 else ()), target=labels if coordinate == 1 else None)
            piece.zero_grad(set_to_none=True)

        return step

    result = bench_ranks._paired(step_of(*pipeline(True)), step_of(*pipeline(False)), reps)
    result["params"] = bench_ranks.params_of(bench_ranks.build_model(config))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    size, reps = ("tiny", 3) if args.quick else ("10M", 31)
    with RankPool(4) as pool:
        result = pool.run(routed_over_bare, size, reps, timeout=1800)[0]
    print(json.dumps({"size": size, "routed_over_bare": result}, indent=1))
    print(
        f"PipelineLoss / bare loss, a 1F1B step of a {result['params'] / 1e6:.1f}M-parameter model, pp2 x dp2 (FSDP2) "
        f"on 4 CPU ranks, 4 micro-batches, median of {reps} interleaved repetitions: {result['ratio']:.3f} "
        f"[p10 {result['ratio_p10']:.3f}, p90 {result['ratio_p90']:.3f}]"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
