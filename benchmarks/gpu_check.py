"""What CPUs cannot check: Liger's Triton kernels and inductor on CUDA, routed through DDP on one GPU.

    python3 benchmarks/gpu_check.py      # one CUDA GPU; ~2-5 minutes on an H200-class GPU

1. Liger's Triton ``LigerFusedLinearCrossEntropyLoss`` routed through single-GPU DDP (nccl, world size 1):
   gradients equal the same loss without DDP.
2. The upstream TensorWrapper crash on CUDA with inductor: compiled Liger DPO, unfrozen reference head, hidden 256,
   vocab 8192+: ``mode="redirect"`` reproduces "Cannot access storage of TensorWrapper", ``mode="auto"`` is
   exact.
3. Routed / native DDP step time on the GPU (interleaved, medians, CUDA-synchronised).

Prints one JSON object; exits non-zero when a check fails. Needs torch with CUDA and liger-kernel.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from wrapperroute import route_loss
from wrapperroute.check.models import TinyConfig, build_model


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p.grad - q.grad).abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def triton_flce(device: torch.device) -> dict[str, Any]:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    config = TinyConfig(vocab=32768, hidden=1024, layers=2, seq=256)
    loss_fn = LigerFusedLinearCrossEntropyLoss()
    ids = torch.randint(0, config.vocab, (4, config.seq), device=device)
    labels = torch.roll(ids, -1, 1)

    def loss(model: Any) -> torch.Tensor:
        hidden = model(ids).flatten(0, 1)
        return loss_fn(model.lm_head.weight, hidden, labels.flatten())

    reference, inner = build_model(config).to(device), build_model(config).to(device)
    loss(reference).backward()
    ddp = DDP(inner, device_ids=[device.index])
    route_loss(ddp, inner, loss, inner).backward()
    diff = _max_diff(inner, reference)
    return {"max_diff_vs_no_ddp": diff, "ok": diff <= 1e-5}


def dpo_crash(device: torch.device) -> dict[str, Any]:
    from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

    config = TinyConfig(vocab=16384, hidden=512, layers=1, seq=64)
    ref_head = torch.nn.Linear(config.hidden, config.vocab, bias=False, device=device)  # not frozen
    ids = torch.randint(0, config.vocab, (4, config.seq), device=device)
    target = torch.roll(ids, -1, 1)
    dpo = LigerFusedLinearDPOLoss()

    def loss(model: Any) -> torch.Tensor:
        hidden = model(ids)
        return dpo(model.lm_head.weight, hidden, target, ref_input=hidden.detach(), ref_weight=ref_head.weight)[0]

    out: dict[str, Any] = {}
    for mode in ("redirect", "auto"):
        torch._dynamo.reset()
        inner, reference = build_model(config).to(device), build_model(config).to(device)
        ddp = DDP(inner, device_ids=[device.index])
        try:
            route_loss(ddp, inner, loss, inner, mode=mode).backward()
            loss(reference).backward()
            out[mode] = {"max_diff": _max_diff(inner, reference)}
        except Exception as error:
            out[mode] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
    out["ok"] = "TensorWrapper" in out["redirect"].get("error", "") and out["auto"].get("max_diff", 1.0) <= 1e-4
    return out


def step_ratio(device: torch.device, reps: int = 41) -> dict[str, Any]:
    config = TinyConfig(vocab=32768, hidden=2048, layers=8, seq=512)
    ids = torch.randint(0, config.vocab, (8, config.seq), device=device)
    labels = torch.roll(ids, -1, 1)

    def fused(model: Any) -> torch.Tensor:
        return F.cross_entropy((model(ids) @ model.lm_head.weight.t()).flatten(0, 1), labels.flatten())

    class Native(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = build_model(config)

        def forward(self) -> torch.Tensor:
            return fused(self.lm)

    native = DDP(Native().to(device), device_ids=[device.index])
    inner = build_model(config).to(device)
    routed = DDP(inner, device_ids=[device.index])

    def timed(step: Any) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        step().backward()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    steps = {"native": lambda: native(), "routed": lambda: route_loss(routed, inner, fused, inner)}
    for step in steps.values():
        timed(step)
    ratios = []
    for rep in range(reps):
        order = ("native", "routed") if rep % 2 else ("routed", "native")
        t = {name: timed(steps[name]) for name in order}
        ratios.append(t["routed"] / t["native"])
    ratios.sort()
    return {"ratio": statistics.median(ratios), "p10": ratios[reps // 10], "p90": ratios[-1 - reps // 10]}


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__}
    for name, check in (("triton_flce", triton_flce), ("dpo_crash", dpo_crash), ("step_ratio", step_ratio)):
        start = time.perf_counter()
        try:
            results[name] = check(device)
        except Exception as error:
            results[name] = {"ok": False, "error": f"{type(error).__name__}: {str(error)[:300]}"}
        results[name]["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(results, indent=2))
    dist.destroy_process_group()
    return 0 if all(results[n].get("ok", True) for n in ("triton_flce", "dpo_crash")) else 1


if __name__ == "__main__":
    sys.exit(main())
