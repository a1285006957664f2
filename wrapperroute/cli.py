"""``wrapperroute check``, ``wrapperroute env`` and the entry of ``wrapperroute audit``.

``check`` spawns N CPU ranks on gloo itself (no torchrun), builds the embedded tiny causal LM, and runs the
matrix {wrappers} x {losses} x {unrouted, routed}, printing the upstream report's table (parameters differing
across ranks). Token-level losses run on batches with a different number of valid tokens on every rank and
micro-batch, their sums divided by ``token_divisor``; one more row shows each rank's own mean on the same
batches (the objective the divisor replaces), as information. ``check --trl`` runs the installed TRL's Liger
trainers instead. Exit status: 0 when every
routed (patched) cell is exact, 1 when any is not, 2 on bad usage. The libraries' warnings and logs from the
ranks are silenced unless ``--verbose``; the user's own process is never touched.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import sys
import time
from typing import Any

from .audit.report import strict_json
from .check.cell import Cell, CellResult, is_exact, run_cell
from .check.console import UsageError, cut, last_error_line, rank_env, say_stale_locks
from .check.losses import LOSSES
from .check.pipeline_cell import PIPELINES, Path, PipelineCase, PipelineCell, run_pipeline_cell
from .check.wrappers import WRAPPERS, WrapperCase

DEFAULT_WRAPPERS = (
    "ddp", "replicate", "fabric_ddp", "fsdp1", "fsdp2", "replicate_fsdp",
    "fsdp1_hybrid", "hsdp", "fsdp2_tail", "fsdp2_keep", "fsdp2_reshard2", "dp2_cp2",  # need 4 ranks
    "tp2_dp2", "tp2_hsdp", "tp4", "hf_tp2_fsdp2", "hf_tp4",  # need 4 ranks; the head sharded on the vocabulary
    "zero1", "zero2", "zero3",
    "pp2_gpipe", "pp2_1f1b", "pp2_interleaved", "pp2_zbv",  # pipelines: 2 ranks
    "pp2_dp2_fsdp2", "pp2_dp2_ddp", "pp2_tp2",  # pipelines: 4 ranks
)  # fmt: skip
# Every layout the check knows: the wrappers around the whole model, and the pipelines (pipeline_cell.py).
LAYOUTS: dict[str, WrapperCase | PipelineCase] = {**WRAPPERS, **PIPELINES}
DEFAULT_LOSSES = ("fused_ce", "backbone_ce", "liger_dpo", "liger_kto", "vocab_ce", "vocab_dpo")
PACKAGES = ("torch", "liger-kernel", "deepspeed", "accelerate", "transformers", "trl", "peft")


def _why_not(case: Any, nproc: int) -> str | None:
    """Why ``case`` (a wrapper or a loss) cannot run here on ``nproc`` ranks, or None."""
    return case.unavailable(nproc) if isinstance(case, WrapperCase | PipelineCase) else case.unavailable()


def _skipped(known: dict[str, Any], default: tuple[str, ...], what: str, nproc: int) -> list[str]:
    """Why each default this machine cannot run is left out: said, so none is left out silently."""
    return [
        f"wrapperroute: skipping {what} {name!r}: it {reason}"
        for name in default
        if (reason := _why_not(known[name], nproc)) is not None
    ]


def _names(value: str | None, known: dict[str, Any], default: tuple[str, ...], what: str, nproc: int) -> list[str]:
    if value is None:
        return [n for n in default if _why_not(known[n], nproc) is None]
    names = [n.strip() for n in value.split(",") if n.strip()]
    for name in names:
        if name not in known or name == "none":
            choices = ", ".join(n for n in known if n != "none")
            raise UsageError(f"unknown {what} {name!r}; choose from: {choices}")
        reason = _why_not(known[name], nproc)
        if reason is not None:
            raise UsageError(f"{what} {name!r} {reason}")
    if not names:
        raise UsageError(f"--{what}s needs at least one name")
    return names


# The path of the row that shows each rank's own mean where token_divisor belongs: information, never a failure.
RANK_MEAN = "rank mean"
# The path of the row that shows a pipeline schedule dividing each micro-batch's own mean by their number (its
# default scale_grads=True) where PipelineLoss belongs: information, never a failure.
SCHEDULE_MEAN = "scaled"


def _verdict(routed: bool | str, cell: CellResult) -> str:
    exact = is_exact(cell)
    if routed == RANK_MEAN:
        return "error" if cell.error is not None else "exact" if exact else "off: what token_divisor fixes"
    if routed == SCHEDULE_MEAN:
        return "error" if cell.error is not None else "exact" if exact else "off: what PipelineLoss fixes"
    if routed:
        return "exact" if exact else "FAIL"
    if cell.error is not None:
        return "crashes"
    if cell.bypassed:
        return "bypassed"
    return "in sync" if exact else "desync"


def _row(wrapper: str, loss: str, routed: bool | str, ranks: list[CellResult]) -> dict[str, Any]:
    """One line of the table (and of ``--json``): the worst rank's figures."""
    worst = max(ranks, key=lambda r: (r.error is not None, r.differ, r.max_ref_diff))
    return {
        "wrapper": wrapper,
        "loss": loss,
        "routed": routed,
        "params": worst.params,
        "differ": worst.differ,
        "max_rank_diff": worst.max_rank_diff,
        "max_ref_diff": worst.max_ref_diff,
        "fell_back": any(r.fell_back for r in ranks),
        "bypassed": sorted({name for r in ranks for name in r.bypassed}),
        "error": last_error_line(worst.error) if worst.error else None,
        "verdict": _verdict(routed, worst),
        "seconds": round(max(r.seconds for r in ranks), 2),
    }


def _failed_row(wrapper: str, loss: str, routed: bool | str, error: Exception) -> dict[str, Any]:
    """A cell whose ranks did not report: a RankFailure carries each rank's traceback, so the row shows the
    first failed rank's exception (its summary line names only the ranks)."""
    errors: dict[int, str] = getattr(error, "errors", None) or {0: str(error)}
    return {
        "wrapper": wrapper, "loss": loss, "routed": routed, "params": 0, "differ": 0,
        "max_rank_diff": 0.0, "max_ref_diff": 0.0, "fell_back": False, "bypassed": [],
        "error": last_error_line(errors[min(errors)]),
        "verdict": "error" if routed in (RANK_MEAN, SCHEDULE_MEAN) else "FAIL" if routed else "crashes",
        "seconds": 0.0,
    }  # fmt: skip


def format_table(rows: list[dict[str, Any]]) -> str:
    header = f"{'wrapper':<15} {'loss':<11} {'path':<9} {'params differing':>16} {'max abs diff':>12} "
    header += f"{'vs reference':>12}  verdict"
    lines = [header, "-" * len(header)]
    for row in rows:
        differing = "-" if row["error"] else f"{row['differ']} / {row['params']}"
        rank_diff = "-" if row["error"] else f"{row['max_rank_diff']:.2g}"
        ref_diff = "-" if row["error"] else f"{row['max_ref_diff']:.2g}"
        verdict = row["verdict"] + (" (fallback)" if row["fell_back"] else "")
        if row["error"]:
            verdict += f": {cut(row['error'], 60)}"
        elif row["bypassed"]:
            verdict += f": {', '.join(row['bypassed'])} around the wrapper's reduction"
        path = _path(row["routed"])
        cells = f"{row['wrapper']:<15} {row['loss']:<11} {path:<9} {differing:>16} {rank_diff:>12} {ref_diff:>12}"
        lines.append(f"{cells}  {verdict}")
    return "\n".join(lines)


def _path(routed: bool | str) -> str:
    return routed if isinstance(routed, str) else "routed" if routed else "unrouted"


def _rank_mean_cell(pairs: list[tuple[str, str]]) -> tuple[str, str, str] | None:
    """The one row showing each rank's own mean on the check's uneven batches: DDP's fused loss when selected,
    else the first pair with a token-level loss."""
    tokens = [pair for pair in pairs if pair[0] in WRAPPERS and LOSSES[pair[1]].summed is not None]
    chosen = ("ddp", "fused_ce") if ("ddp", "fused_ce") in tokens else tokens[0] if tokens else None
    return None if chosen is None else (*chosen, RANK_MEAN)


def _cell(wrapper: str, loss: str, routed: bool | str, args: argparse.Namespace) -> tuple[Any, Any]:
    """What every rank runs for one row: the cell's function and its description."""
    if wrapper in PIPELINES:  # the schedule's micro-batches are the step's: at least 2, so they can differ
        path: Path = "scaled" if routed == SCHEDULE_MEAN else "routed" if routed else "bare"
        return run_pipeline_cell, PipelineCell(PIPELINES[wrapper], path, args.steps, max(args.accum, 2))
    cell = Cell(wrapper=wrapper, loss=loss, routed=bool(routed), steps=args.steps, accum=args.accum,
                normalise="rank_mean" if routed == RANK_MEAN else "divisor")  # fmt: skip
    return run_cell, cell


def check(args: argparse.Namespace) -> int:
    if args.nproc < 2:
        raise UsageError(f"--nproc must be at least 2 to compare ranks, got {args.nproc}")
    if args.accum < 1:
        raise UsageError(f"--accum must be at least 1 micro-batch per step, got {args.accum}")
    if args.trl:
        from .check.trl_report import check_trl

        return check_trl(args)
    wrappers = _names(args.wrappers, LAYOUTS, DEFAULT_WRAPPERS, "wrapper", args.nproc)
    losses = _names(args.losses, LOSSES, DEFAULT_LOSSES, "loss", args.nproc)
    skipped = _skipped(LAYOUTS, DEFAULT_WRAPPERS, "wrapper", args.nproc) if args.wrappers is None else []
    skipped += _skipped(LOSSES, DEFAULT_LOSSES, "loss", args.nproc) if args.losses is None else []
    for line in skipped:
        print(line, file=sys.stderr)
    from .ranks import RankPool

    pairs = [(w, loss) for w in wrappers for loss in losses if LAYOUTS[w].runs(loss)]
    cells: list[tuple[str, str, bool | str]] = [(w, loss, routed) for w, loss in pairs for routed in (False, True)]
    if args.rank_means:  # each rank's own mean beside every token-level loss's routed cell
        cells += [(w, loss, RANK_MEAN) for w, loss in pairs if w in WRAPPERS and LOSSES[loss].summed is not None]
    elif (rank_mean := _rank_mean_cell(pairs)) is not None:
        cells.append(rank_mean)
    pipelines = [(w, loss) for w, loss in pairs if w in PIPELINES]
    cells += [(w, loss, SCHEDULE_MEAN) for w, loss in (pipelines if args.rank_means else pipelines[:1])]
    left_out = sorted({w for w in wrappers if not all(LAYOUTS[w].runs(loss) for loss in losses)})
    for name in left_out:
        print(f"wrapperroute: {name} runs only {', '.join(LAYOUTS[name].losses or ())}", file=sys.stderr)
    if not cells:
        raise UsageError(
            "no wrapper given runs any loss given (a tensor-parallel head needs a vocab_* loss; a pipeline runs "
            "fused_ce, or vocab_ce on a tensor-parallel head)"
        )
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    progress = sys.stderr
    env = rank_env(args.verbose)
    with RankPool(args.nproc, env=env) as pool:
        for index, (wrapper, loss, routed) in enumerate(cells, 1):
            if LAYOUTS[wrapper].requires == "deepspeed":  # its first use builds a C++ op: never wait silently
                say_stale_locks(env)
            print(f"[{index}/{len(cells)}] {wrapper} / {loss} / {_path(routed)} ...", end="", file=progress,
                  flush=True)  # fmt: skip
            try:
                ranks = pool.run(*_cell(wrapper, loss, routed, args), timeout=args.timeout)
                row = _row(wrapper, loss, routed, ranks)
            except Exception as error:  # a rank raised outside the cell, died or hung: report it, keep going
                row = _failed_row(wrapper, loss, routed, error)
                if not args.verbose:
                    print(" (--verbose shows the ranks' own output)", end="", file=progress)
            rows.append(row)
            print(f" {row['verdict']} ({row['seconds']}s)", file=progress, flush=True)
    elapsed = time.perf_counter() - start
    failed = [r for r in rows if r["routed"] is True and r["verdict"] != "exact"]
    if args.json:
        summary = {"nproc": args.nproc, "seconds": round(elapsed, 1), "ok": not failed, "cells": rows}
        print(json.dumps(strict_json(summary), allow_nan=False))
    else:
        print(format_table(rows))
        print(f"\n{len(rows)} cells on {args.nproc} CPU ranks in {elapsed:.0f}s: ", end="")
        print("every routed cell exact." if not failed else f"{len(failed)} routed cell(s) FAILED.")
    return 1 if failed else 0


def env(args: argparse.Namespace) -> int:
    print(f"python        {platform.python_version()} ({platform.machine()})")
    for package in PACKAGES:
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            version = "not installed"
        print(f"{package:<13} {version}")
    print("wrappers      " + ", ".join(n for n, w in WRAPPERS.items() if n != "none" and w.available()))
    print("losses        " + ", ".join(n for n, c in LOSSES.items() if c.available()))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wrapperroute",
        description="Prove that a fused loss run inside a distributed wrapper keeps gradients exact (check), and "
        "whether a training script keeps its data-parallel replicas in sync (audit).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("check", help="prove routed gradients are exact on local CPU ranks")
    run.add_argument("--nproc", type=int, default=2, help="ranks to spawn (default 2)")
    run.add_argument("--wrappers", help=f"comma-separated subset of: {', '.join(DEFAULT_WRAPPERS)}, zero0")
    run.add_argument("--losses", help=f"comma-separated subset of: {', '.join(LOSSES)}")
    run.add_argument("--steps", type=int, default=1, help="optimizer steps per cell (default 1)")
    run.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step (default 2)")
    run.add_argument(
        "--rank-means",
        action="store_true",
        help="a row of each rank's own mean for every token-level loss (default: one row)",
    )
    run.add_argument("--timeout", type=float, default=300.0, help="seconds a cell may take (default 300)")
    run.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    run.add_argument("--verbose", action="store_true", help="show the libraries' warnings and logs from the ranks")
    run.add_argument(
        "--trl",
        action="store_true",
        help="run the installed TRL's trainers with a fused Liger loss (DPO, KTO, GRPO, GKD, distillation, GOLD, "
        "IW-OPD, SDPO, SDFT) under DDP, ZeRO-3 and FSDP2 (--wrappers picks among ddp, zero3, fsdp2), as installed "
        "and patched",
    )
    run.add_argument(
        "--trainers", help="with --trl: comma-separated subset of dpo, kto, grpo, gkd, distill, gold, iwopd, sdpo, sdft"
    )
    run.set_defaults(handler=check)
    commands.add_parser("env", help="versions and what is available").set_defaults(handler=env)
    commands.add_parser(
        "audit",
        help="run a training script unmodified on every rank and report whether its replicas stay in sync "
        "(wrapperroute audit [--steps K|all] [--json PATH] [--on-desync exit|raise|warn] SCRIPT [ARGS...])",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    program = argv is None  # the process's own entry point (the console script, python -m wrapperroute)
    argv = list(sys.argv[1:] if argv is None else argv)
    # Launchers in module mode (deepspeed --module, torch.distributed.launch) put --local_rank=N first; the same
    # number is in the LOCAL_RANK environment variable, which is what torch reads.
    while argv and argv[0].split("=")[0] in ("--local_rank", "--local-rank"):
        del argv[: 1 if "=" in argv[0] else 2]
    if argv[:1] == ["audit"]:  # the script's own arguments follow: not for argparse
        from .audit import main as audit_main

        return audit_main(argv[1:], leave=program)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.handler(args)
    except UsageError as error:
        print(f"wrapperroute: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("wrapperroute: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
