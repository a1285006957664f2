"""``wrapperroute check``, ``wrapperroute env`` and the entry of ``wrapperroute audit``.

``check`` spawns N CPU ranks on gloo itself (no torchrun), builds the embedded tiny causal LM, and runs the
matrix {wrappers} x {losses} x {unrouted, routed}, printing the upstream report's table (parameters differing
across ranks). ``check --trl`` runs the installed TRL's Liger trainers instead. Exit status: 0 when every
routed (patched) cell is exact, 1 when any is not, 2 on bad usage. The libraries' warnings and logs from the
ranks are silenced unless ``--verbose``; the user's own process is never touched.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
import time
from typing import Any

from .check.cell import Cell, is_exact, run_cell
from .check.losses import LOSSES
from .check.wrappers import WRAPPERS, WrapperCase

DEFAULT_WRAPPERS = (
    "ddp", "replicate", "fabric_ddp", "fsdp1", "fsdp2", "replicate_fsdp",
    "hsdp", "fsdp2_tail", "fsdp2_keep", "fsdp2_reshard2",  # need 4 ranks
    "zero1", "zero2", "zero3",
)  # fmt: skip
DEFAULT_LOSSES = ("fused_ce", "backbone_ce", "liger_dpo", "liger_kto")
PACKAGES = ("torch", "liger-kernel", "deepspeed", "accelerate", "transformers", "trl", "peft")


class UsageError(Exception):
    pass


def _why_not(case: Any, nproc: int) -> str | None:
    """Why ``case`` (a wrapper or a loss) cannot run here on ``nproc`` ranks, or None."""
    return case.unavailable(nproc) if isinstance(case, WrapperCase) else case.unavailable()


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


def _verdict(routed: bool, cell: dict[str, Any]) -> str:
    exact = is_exact(cell)
    if routed:
        return "exact" if exact else "FAIL"
    if cell["error"] is not None:
        return "crashes"
    return "in sync" if exact else "desync"


def _last_error_line(text: str) -> str:
    """The exception line of a traceback (Dynamo appends advice after it)."""
    lines = [line.strip() for line in text.strip().splitlines()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Failed")) and " " not in head:
            return line
    return lines[-1]


def _row(wrapper: str, loss: str, routed: bool, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    worst = max(ranks, key=lambda r: (r["error"] is not None, r["differ"], r["max_ref_diff"]))
    error = _last_error_line(worst["error"]) if worst["error"] else None
    return {
        "wrapper": wrapper,
        "loss": loss,
        "routed": routed,
        "params": worst["params"],
        "differ": worst["differ"],
        "max_rank_diff": worst["max_rank_diff"],
        "max_ref_diff": worst["max_ref_diff"],
        "fell_back": any(r["fell_back"] for r in ranks),
        "error": error,
        "verdict": _verdict(routed, worst),
        "seconds": round(max(r["seconds"] for r in ranks), 2),
    }


def _failed_row(wrapper: str, loss: str, routed: bool, error: Exception) -> dict[str, Any]:
    """A cell whose ranks did not report: a RankFailure carries each rank's traceback, so the row shows the
    first failed rank's exception (its summary line names only the ranks)."""
    errors: dict[int, str] = getattr(error, "errors", None) or {0: str(error)}
    return {
        "wrapper": wrapper, "loss": loss, "routed": routed, "params": 0, "differ": 0,
        "max_rank_diff": 0.0, "max_ref_diff": 0.0, "fell_back": False,
        "error": _last_error_line(errors[min(errors)]), "verdict": "FAIL" if routed else "crashes",
        "seconds": 0.0,
    }  # fmt: skip


def format_table(rows: list[dict[str, Any]]) -> str:
    header = f"{'wrapper':<14} {'loss':<11} {'path':<9} {'params differing':>16} {'max abs diff':>12} "
    header += f"{'vs reference':>12}  verdict"
    lines = [header, "-" * len(header)]
    for row in rows:
        differing = "-" if row["error"] else f"{row['differ']} / {row['params']}"
        rank_diff = "-" if row["error"] else f"{row['max_rank_diff']:.2g}"
        ref_diff = "-" if row["error"] else f"{row['max_ref_diff']:.2g}"
        verdict = row["verdict"] + (" (fallback)" if row["fell_back"] else "")
        if row["error"]:
            verdict += f": {_cut(row['error'], 60)}"
        path = "routed" if row["routed"] else "unrouted"
        cells = f"{row['wrapper']:<14} {row['loss']:<11} {path:<9} {differing:>16} {rank_diff:>12} {ref_diff:>12}"
        lines.append(f"{cells}  {verdict}")
    return "\n".join(lines)


# What the rank workers of a quiet run set (never the user's own process): the libraries' warnings, log lines
# and progress bars would land in the middle of the progress lines.
QUIET_ENV = {
    "WRAPPERROUTE_QUIET": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "DATASETS_VERBOSITY": "error",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "TQDM_DISABLE": "1",
    "PYTHONWARNINGS": "ignore",
}


def _rank_env(verbose: bool) -> dict[str, str]:
    return {**_cache_env(), **({} if verbose else QUIET_ENV)}


def _cache_env() -> dict[str, str]:
    base = os.path.join(os.path.expanduser("~"), ".cache", "wrapperroute")
    return {
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", os.path.join(base, "inductor")),
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", os.path.join(base, "torch_extensions")),
    }


def check(args: argparse.Namespace) -> int:
    if args.nproc < 2:
        raise UsageError(f"--nproc must be at least 2 to compare ranks, got {args.nproc}")
    if args.trl:
        return check_trl(args)
    wrappers = _names(args.wrappers, WRAPPERS, DEFAULT_WRAPPERS, "wrapper", args.nproc)
    losses = _names(args.losses, LOSSES, DEFAULT_LOSSES, "loss", args.nproc)
    skipped = _skipped(WRAPPERS, DEFAULT_WRAPPERS, "wrapper", args.nproc) if args.wrappers is None else []
    skipped += _skipped(LOSSES, DEFAULT_LOSSES, "loss", args.nproc) if args.losses is None else []
    for line in skipped:
        print(line, file=sys.stderr)
    from .ranks import RankPool

    cells = [(w, loss, routed) for w in wrappers for loss in losses for routed in (False, True)]
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    progress = sys.stderr
    with RankPool(args.nproc, env=_rank_env(args.verbose)) as pool:
        for index, (wrapper, loss, routed) in enumerate(cells, 1):
            path = "routed" if routed else "unrouted"
            print(f"[{index}/{len(cells)}] {wrapper} / {loss} / {path} ...", end="", file=progress, flush=True)
            cell = Cell(wrapper=wrapper, loss=loss, routed=routed, steps=args.steps)
            try:
                ranks = pool.run(run_cell, cell, timeout=args.timeout)
                row = _row(wrapper, loss, routed, ranks)
            except Exception as error:  # a rank raised outside the cell, died or hung: report it, keep going
                row = _failed_row(wrapper, loss, routed, error)
                if not args.verbose:
                    print(" (--verbose shows the ranks' own output)", end="", file=progress)
            rows.append(row)
            print(f" {row['verdict']} ({row['seconds']}s)", file=progress, flush=True)
    elapsed = time.perf_counter() - start
    failed = [r for r in rows if r["routed"] and r["verdict"] != "exact"]
    if args.json:
        print(json.dumps({"nproc": args.nproc, "seconds": round(elapsed, 1), "ok": not failed, "cells": rows}))
    else:
        print(format_table(rows))
        print(f"\n{len(rows)} cells on {args.nproc} CPU ranks in {elapsed:.0f}s: ", end="")
        print("every routed cell exact." if not failed else f"{len(failed)} routed cell(s) FAILED.")
    return 1 if failed else 0


def _liger_trainers() -> tuple[str, list[str], list[str]]:
    """The installed TRL's version, the trainers of ``TRAINERS`` whose config has ``use_liger_kernel``, and a
    line for each left out."""
    import dataclasses

    import trl

    from .check.trl_cells import TRAINERS

    found, left = [], []
    for name, (module_name, config_name, trainer_name) in TRAINERS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            module = None
        config = getattr(module, config_name, None)
        if config is None or getattr(module, trainer_name, None) is None:
            left.append(f"wrapperroute: TRL {trl.__version__} has no {trainer_name}: not checked")
        elif "use_liger_kernel" not in {field.name for field in dataclasses.fields(config)}:
            left.append(f"wrapperroute: TRL {trl.__version__}'s {config_name} has no use_liger_kernel: no Liger path")
        else:
            found.append(name)
    return str(trl.__version__), found, left


def check_trl(args: argparse.Namespace) -> int:
    """The installed TRL's Liger trainers, one step each on local CPU ranks under DDP, as installed and with
    ``patch_trl()``: what a TRL fork's maintainer runs on the fork."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        raise UsageError("--trl checks the installed TRL, and TRL is not installed (pip install wrapperroute[trl])")
    missing = [name for name in ("liger_kernel", "datasets") if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"--trl runs TRL's Liger losses and needs {', '.join(missing)} installed")
    version, trainers, left = _liger_trainers()
    for line in left:
        print(line, file=sys.stderr)
    if not trainers:
        print(f"wrapperroute check --trl: TRL {version} has no trainer with a Liger path: nothing to check")
        return 0
    import tempfile

    from .check.trl_cells import compare_ranks, trl_step
    from .ranks import RankPool

    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    with RankPool(args.nproc, env=_rank_env(args.verbose)) as pool, tempfile.TemporaryDirectory() as folder:
        for trainer in trainers:
            for variant in ("unpatched", "patched"):
                print(f"TRL {version} {trainer} / {variant} ...", end="", file=sys.stderr, flush=True)
                try:
                    row = compare_ranks(pool.run(trl_step, trainer, variant, folder, timeout=args.timeout))
                    if row["errors"] and len(row["errors"]) < args.nproc:
                        pool.close()  # one rank failed, another timed out in a collective: start afresh
                except Exception as error:  # a rank died or hung outside the step
                    errors = getattr(error, "errors", None) or {0: str(error)}
                    row = {"trainer": trainer, "variant": variant, "error": errors[min(errors)], "liger_paths": {}}
                row["verdict"] = _trl_verdict(row)
                rows.append(row)
                print(f" {row['verdict']}", file=sys.stderr, flush=True)
    failed = [r for r in rows if r["variant"] == "patched" and r["verdict"] != "exact"]
    cells = [_trl_cell(version, row) for row in rows]
    if args.json:
        report = {"trl": version, "nproc": args.nproc, "seconds": round(time.perf_counter() - start, 1)}
        print(json.dumps({**report, "ok": not failed, "cells": cells}))
    else:
        print(format_trl_table(cells))
        print(f"\nTRL {version}, {len(cells)} cells on {args.nproc} CPU ranks: ", end="")
        print("every patched cell exact." if not failed else f"{len(failed)} patched cell(s) FAILED.")
    return 1 if failed else 0


def _trl_verdict(row: dict[str, Any]) -> str:
    if row.get("error"):
        return "crashes" if row["variant"] == "unpatched" else "FAIL"
    if row.get("nonzero") == 0:  # a step that produced no gradient cannot show a desync: never "exact"
        return "no gradient"
    exact = row["differ"] == 0 and row["max_diff"] == 0.0
    if row["variant"] == "patched":
        return "exact" if exact else "FAIL"
    return "in sync" if exact else "desync"


def _trl_cell(version: str, row: dict[str, Any]) -> dict[str, Any]:
    return {
        "trl": version,
        "trainer": row["trainer"],
        "wrapper": row.get("wrapper", "DistributedDataParallel"),
        "path": row["variant"],
        "params": row.get("params"),
        "differ": row.get("differ"),
        "max_diff": row.get("max_diff"),
        "verdict": row["verdict"],
        "liger_paths": row.get("liger_paths", {}),
        "error": _last_error_line(row["error"]) if row.get("error") else None,
    }


def format_trl_table(cells: list[dict[str, Any]]) -> str:
    header = f"{'trainer':<8} {'wrapper':<8} {'path':<10} {'params differing':>16} {'max abs diff':>12}  verdict"
    lines = [header, "-" * len(header)]
    for cell in cells:
        differing = "-" if cell["error"] else f"{cell['differ']} / {cell['params']}"
        diff = "-" if cell["error"] else f"{cell['max_diff']:.2g}"
        verdict = cell["verdict"] + (f": {_cut(cell['error'], 70)}" if cell["error"] else "")
        wrapper = "DDP" if cell["wrapper"] == "DistributedDataParallel" else cell["wrapper"]
        lines.append(f"{cell['trainer']:<8} {wrapper:<8} {cell['path']:<10} {differing:>16} {diff:>12}  {verdict}")
        lines += [f"{'':<28}{path} ({count}x)" for path, count in cell["liger_paths"].items()]
    return "\n".join(lines)


def _cut(text: str, width: int) -> str:
    """``text`` cut at a word boundary to at most ``width`` characters (``--json`` keeps all of it)."""
    if len(text) <= width:
        return text
    return text[: width - 3].rsplit(" ", 1)[0] + " ..."


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
    parser = argparse.ArgumentParser(prog="wrapperroute", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("check", help="prove routed gradients are exact on local CPU ranks")
    run.add_argument("--nproc", type=int, default=2, help="ranks to spawn (default 2)")
    run.add_argument("--wrappers", help=f"comma-separated subset of: {', '.join(DEFAULT_WRAPPERS)}, zero0")
    run.add_argument("--losses", help=f"comma-separated subset of: {', '.join(LOSSES)}")
    run.add_argument("--steps", type=int, default=1, help="optimizer steps per cell (default 1)")
    run.add_argument("--timeout", type=float, default=300.0, help="seconds a cell may take (default 300)")
    run.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    run.add_argument("--verbose", action="store_true", help="show the libraries' warnings and logs from the ranks")
    run.add_argument(
        "--trl", action="store_true", help="run the installed TRL's Liger trainers (DPO, KTO), unpatched and patched"
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
    argv = list(sys.argv[1:] if argv is None else argv)
    # Launchers in module mode (deepspeed --module, torch.distributed.launch) put --local_rank=N first; the same
    # number is in the LOCAL_RANK environment variable, which is what torch reads.
    while argv and argv[0].split("=")[0] in ("--local_rank", "--local-rank"):
        del argv[: 1 if "=" in argv[0] else 2]
    if argv[:1] == ["audit"]:  # the script's own arguments follow: not for argparse
        from .audit import main as audit_main

        return audit_main(argv[1:])
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
