"""``wrapperroute check --trl``: the installed TRL's trainers with a fused Liger loss, one step each on local CPU
ranks under every wrapper, as installed and with ``patch_trl()``: what a TRL fork's maintainer runs on the fork.

For each trainer, the ``local`` layout runs first (the model unwrapped: each rank trains alone on its shard, as
one process would); the mean of the ranks' gradients is the reference every wrapper's step is held to. A
patched cell is exact when its gradients are identical across ranks, non-zero, and within ``TOLERANCE`` of
that reference. Exit status: 0 when every patched cell is exact.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import sys
import tempfile
import time
from typing import Any

from .cell import REFERENCE_TOLERANCE as TOLERANCE
from .console import UsageError, cut, last_error_line, rank_env, say_stale_locks
from .trl_cells import TRAINERS, compare_ranks, trainer_classes, trl_step
from .trl_layouts import LAYOUTS

LAYOUT_NAMES = {"ddp": "DDP", "zero3": "ZeRO-3", "fsdp2": "FSDP2", "fsdp2_head": "FSDP2 head unit"}


def liger_trainers() -> tuple[str, list[str], list[str]]:
    """The installed TRL's version, the trainers of ``TRAINERS`` it has with ``use_liger_kernel``, and a line
    for each left out: missing here, or found in the installed package with a Liger path but no data set-up."""
    import trl

    from ..integrations.trl import fused_loss_trainers

    found, left = [], []
    for name, (modules, config_name, trainer_name) in TRAINERS.items():
        try:
            found_classes = trainer_classes(name)
        except Exception as error:  # SDFT on TRL 1.6-1.14 without PEFT: a NameError at import
            left.append(f"wrapperroute: {', '.join(modules)} fails to import ({type(error).__name__}: {error}): "
                        f"{trainer_name} not checked")  # fmt: skip
            continue
        if found_classes is None:
            left.append(f"wrapperroute: TRL {trl.__version__} has no {trainer_name}: not checked")
        elif "use_liger_kernel" not in {field.name for field in dataclasses.fields(found_classes[0])}:
            left.append(f"wrapperroute: TRL {trl.__version__}'s {config_name} has no use_liger_kernel: no Liger path")
        else:
            found.append(name)
    known = {trainer_name for _, _, trainer_name in TRAINERS.values()}
    for cls in fused_loss_trainers():
        if cls.__name__ not in known:
            left.append(f"wrapperroute: {cls.__module__}.{cls.__name__} reads use_liger_kernel; check --trl has "
                        "no data set-up for it: patched by patch_trl(), not checked")  # fmt: skip
    return str(trl.__version__), found, left


def _pick(value: str | None, known: tuple[str, ...] | list[str], what: str) -> list[str]:
    if value is None:
        return list(known)
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise UsageError(f"unknown {what} {', '.join(unknown) or repr(value)}; choose from {', '.join(known)}")
    return names


def check_trl(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("trl") is None:
        raise UsageError("--trl checks the installed TRL, and TRL is not installed (pip install wrapperroute[trl])")
    missing = [name for name in ("liger_kernel", "datasets") if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"--trl runs TRL's Liger losses and needs {', '.join(missing)} installed")
    layouts = _pick(args.wrappers, LAYOUTS, "TRL wrapper")
    if "zero3" in layouts and importlib.util.find_spec("deepspeed") is None:
        print("wrapperroute: deepspeed is not installed: zero3 not checked", file=sys.stderr)
        layouts.remove("zero3")
    version, trainers, left = liger_trainers()
    for line in left:
        print(line, file=sys.stderr)
    trainers = [name for name in _pick(args.trainers, list(TRAINERS), "trainer") if name in trainers]
    if not trainers:
        print(f"wrapperroute check --trl: TRL {version} has no trainer with a Liger path to check: nothing checked")
        return 0
    from ..ranks import RankPool

    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    env = rank_env(args.verbose)
    say_stale_locks(env)
    with RankPool(args.nproc, env=env) as pool, tempfile.TemporaryDirectory() as folder:

        def step(trainer: str, variant: str, layout: str) -> list[dict[str, Any]]:
            try:
                results: list[dict[str, Any]] = pool.run(trl_step, trainer, variant, folder, layout,
                                                         timeout=args.timeout)  # fmt: skip
            except Exception as error:  # a rank died or hung outside the step
                errors = getattr(error, "errors", None) or {0: str(error)}
                failed = {"trainer": trainer, "variant": variant, "layout": layout, "error": errors[min(errors)],
                          "grads": {}, "liger_paths": {}}  # fmt: skip
                return [failed] * args.nproc
            if 0 < sum(bool(r["error"]) for r in results) < args.nproc:
                pool.close()  # one rank failed, another timed out in a collective: start afresh
            return results

        for trainer in trainers:
            print(f"TRL {version} {trainer} / reference ...", end="", file=sys.stderr, flush=True)
            reference = step(trainer, "unpatched", "local")
            print(" failed" if reference[0]["error"] else " done", file=sys.stderr, flush=True)
            for layout in layouts:
                for variant in ("unpatched", "patched"):
                    print(f"TRL {version} {trainer} / {layout} / {variant} ...", end="", file=sys.stderr, flush=True)
                    row = compare_ranks(step(trainer, variant, layout), reference)
                    row["verdict"] = trl_verdict(row)
                    rows.append(row)
                    print(f" {row['verdict']}", file=sys.stderr, flush=True)
    failed = [r for r in rows if r["variant"] == "patched" and r["verdict"] != "exact"]
    cells = [_cell(version, row) for row in rows]
    if args.json:
        report = {"trl": version, "nproc": args.nproc, "seconds": round(time.perf_counter() - start, 1)}
        print(json.dumps({**report, "ok": not failed, "cells": cells}))
    else:
        print(format_trl_table(cells))
        print(f"\nTRL {version}, {len(cells)} cells on {args.nproc} CPU ranks: ", end="")
        print("every patched cell exact." if not failed else f"{len(failed)} patched cell(s) FAILED.")
    return 1 if failed else 0


def trl_verdict(row: dict[str, Any]) -> str:
    """``crashes``/``FAIL`` for an error; ``no gradient`` for a step that produced none (it can show nothing);
    ``desync`` when the ranks differ; ``wrong`` when they agree on a gradient off the reference; ``no reference``
    when the reference step failed; else ``in sync`` (as installed) or ``exact`` (patched)."""
    patched = row["variant"] != "unpatched"
    if row.get("error"):
        return "FAIL" if patched else "crashes"
    if row.get("nonzero") == 0:
        return "no gradient"
    if row["differ"] or row["max_diff"]:
        return "FAIL" if patched else "desync"
    if row.get("ref_diff") is None:
        return "no reference"
    if row["ref_diff"] > TOLERANCE:
        return "FAIL" if patched else "wrong"
    return "exact" if patched else "in sync"


def _cell(version: str, row: dict[str, Any]) -> dict[str, Any]:
    wrapper = row.get("wrapper") or row.get("layout", "?")
    return {
        "trl": version,
        "trainer": row["trainer"],
        "layout": row.get("layout", "ddp"),
        "wrapper": wrapper,
        "path": row["variant"],
        "params": row.get("params"),
        "differ": row.get("differ"),
        "max_diff": row.get("max_diff"),
        "ref_diff": row.get("ref_diff"),
        "verdict": row["verdict"],
        "liger_paths": row.get("liger_paths", {}),
        "error": last_error_line(row["error"]) if row.get("error") else None,
    }


def format_trl_table(cells: list[dict[str, Any]]) -> str:
    width = max(len(name) for name in LAYOUT_NAMES.values())
    header = (f"{'trainer':<8} {'wrapper':<{width}} {'path':<10} {'params differing':>16} {'across ranks':>12} "
              f"{'vs reference':>12}  verdict")  # fmt: skip
    lines = [header, "-" * len(header)]
    for cell in cells:
        failed = cell["error"] is not None
        differing = "-" if failed else f"{cell['differ']} / {cell['params']}"
        across = "-" if failed else f"{cell['max_diff']:.2g}"
        versus = "-" if failed or cell["ref_diff"] is None else f"{cell['ref_diff']:.2g}"
        verdict = cell["verdict"] + (f": {cut(cell['error'], 70)}" if failed else "")
        wrapper = LAYOUT_NAMES.get(cell["layout"], cell["layout"])
        lines.append(f"{cell['trainer']:<8} {wrapper:<{width}} {cell['path']:<10} {differing:>16} {across:>12} "
                     f"{versus:>12}  {verdict}")  # fmt: skip
        lines += [f"{'':<{width + 20}}{path} ({count}x)" for path, count in cell["liger_paths"].items()]
    return "\n".join(lines)
