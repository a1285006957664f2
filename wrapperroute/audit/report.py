"""What the audit says: each comparison it made (a checkpoint), the table of a desynced one, the final line, and
the ``--json`` report."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..crossrank import Mismatch, what_of


@dataclass
class Checkpoint:
    """One comparison: before optimizer step ``step`` of optimizer ``optimizer``, or at the end. ``differences``:
    the tensors whose copies differ, worst first; ``nonfinite``: the keys (``"gradient <name>"``) of those NaN or
    inf alike on every copy."""

    label: str
    compared: int
    differences: list[Mismatch] = field(default_factory=list)
    nonfinite: list[str] = field(default_factory=list)


class Audited(Protocol):
    """What the report reads of an audit (``session.Audit``)."""

    checkpoints: list[Checkpoint]
    kinds: set[str]
    alone: dict[str, int]
    failure: str | None
    stepped: bool
    end_missed: bool
    steps: int | None

    @property
    def desync(self) -> bool: ...

    @property
    def optimizers_seen(self) -> int: ...


def format_checkpoint(checkpoint: Checkpoint, top: int = 8) -> str:
    """The comparison table of one desynced checkpoint: tensors differing and the worst by name."""
    params = sorted({d.name for d in checkpoint.differences})
    lines = [
        f"wrapperroute audit, {checkpoint.label}: {len(params)} parameter(s) differ across replicas "
        f"({len(checkpoint.differences)} of {checkpoint.compared} tensors compared)",
        f"  {'max abs diff':>12}  {'of':<9} parameter",
    ]
    for difference in checkpoint.differences[:top]:
        lines.append(f"  {difference.describe():>12}  {difference.what:<9} {difference.name}")
    if len(checkpoint.differences) > top:
        lines.append(f"  ... and {len(checkpoint.differences) - top} more")
    return "\n".join(lines)


def final_line(audit: Audited, script_failed: str | None = None) -> str:
    """The one line rank 0 prints at the end: DESYNC, in sync, FAILED (the audit's own error), or nothing
    audited, with what was seen."""
    checkpoints = audit.checkpoints
    steps = sum(1 for c in checkpoints if c.label.startswith("step"))
    wrappers = ", ".join(sorted(audit.kinds)) or "none"
    if audit.desync:
        first = next(c for c in checkpoints if c.differences)
        params = {d.name for c in checkpoints for d in c.differences}
        worst = max((d for c in checkpoints for d in c.differences), key=lambda d: (d.nonfinite > 0, d.max_abs_diff))
        how = "NaN or inf beside other values" if worst.nonfinite else f"{worst.max_abs_diff:.3g}"
        where = first.label if first.label.startswith("before") else f"at {first.label}"
        line = (
            f"wrapperroute audit: DESYNC ({steps} step(s) audited; {len(params)} parameter(s) differing, first "
            f"{where}; worst {how} in {worst.name} ({worst.what}); wrappers: {wrappers}{_alone(audit)})"
        )
    elif audit.failure is not None:
        line = (
            f"wrapperroute audit: FAILED, the audit's own error: {audit.failure} ({steps} step(s) audited before "
            f"it, none desynced; the script ran on unaudited; wrappers: {wrappers})"
        )
    elif checkpoints:
        compared = max(c.compared for c in checkpoints)
        line = (
            f"wrapperroute audit: in sync ({steps} step(s) audited, up to {compared} tensors compared per step, "
            f"0 parameters differing, worst 0; wrappers: {wrappers}{_alone(audit)})"
        )
    else:
        line = f"wrapperroute audit: nothing audited ({_why_nothing(audit)})"
    nonfinite = [(c.label, *what_of(key)) for c in checkpoints for key in c.nonfinite]  # (label, what, name)
    if nonfinite:
        label, what, name = nonfinite[0]
        tensors = len({(what, name) for _, what, name in nonfinite})
        line += f"; {tensors} tensor(s) NaN or inf alike on every rank, first at {label}: {name} ({what})"
    if audit.end_missed and audit.steps is not None:
        line += (
            "; no final comparison (the script's models were freed before it ended: call "
            "dist.destroy_process_group() at the end of the script to have one)"
        )
    if audit.desync and audit.failure is not None:
        line += f"; then the audit itself failed: {audit.failure}"
    return line + (f"; the script failed: {script_failed}" if script_failed else "")


def _alone(audit: Audited) -> str:
    """The trainable parameters not compared, by why: ``"; not compared: 12 sharded"``."""
    if not audit.alone:
        return ""
    return "; not compared: " + ", ".join(f"{count} {why}" for why, count in sorted(audit.alone.items()))


def _why_nothing(audit: Audited) -> str:
    if not audit.optimizers_seen:
        return "no optimizer step ran"
    if not audit.stepped:
        return "torch.distributed ran no more than one rank while optimizers stepped"
    found = ", ".join(sorted(audit.kinds))
    if found:
        alone = sum(audit.alone.values())
        return (f"no trainable parameter of the distributed wrappers found ({found}) has a copy on another rank"
                f"{_alone(audit).replace('; not compared:', ':')}" if alone else
                f"the distributed wrappers found ({found}) hold no trainable parameter")  # fmt: skip
    return (
        "optimizers stepped on several ranks, but no distributed wrapper holds their parameters: each rank "
        "may be training its own copy"
    )


def strict_json(value: Any) -> Any:
    """``value`` with every non-finite float written as a string (``"inf"``, ``"nan"``): JSON has no infinity,
    and Python's ``Infinity`` is refused by strict readers."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(item) for item in value]
    return value


def report(audit: Audited, final: str, exit_status: int) -> dict[str, Any]:
    """The ``--json`` report (non-finite differences written ``"inf"``)."""
    verdict = "desync" if audit.desync else "failed" if audit.failure else "in sync" if audit.checkpoints else (
        "nothing audited")  # fmt: skip
    return strict_json(
        {
            "verdict": verdict,
            "final_line": final,
            "exit_status": exit_status,
            "wrappers": sorted(audit.kinds),
            "not_compared": dict(sorted(audit.alone.items())),
            "audit_failure": audit.failure,
            "checkpoints": [
                {
                    "label": c.label,
                    "compared": c.compared,
                    "differences": [
                        {"key": d.name, "what": d.what, "max_abs_diff": d.max_abs_diff, "nonfinite": d.nonfinite}
                        for d in c.differences
                    ],
                    "nonfinite": [dict(zip(("what", "key"), what_of(key), strict=True)) for key in c.nonfinite],
                }
                for c in audit.checkpoints
            ],
        }
    )
