"""What the audit says: each comparison it made (a checkpoint), the table of a desynced one, the final line, and
the ``--json`` report."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..arrivals import Bypass
from ..crossrank import Mismatch, what_of


@dataclass
class Checkpoint:
    """One comparison: before optimizer step ``step`` of optimizer ``optimizer``, or at the end. ``differences``:
    the tensors whose copies differ, worst first; ``nonfinite``: the keys (``"gradient <name>"``) of those NaN or
    inf alike on every copy; ``verified``: sharded gradients that came only through their wrapper's reduction
    since the last look (the most on any rank); ``bypassed``: those that arrived around it (arrivals.py)."""

    label: str
    compared: int
    differences: list[Mismatch] = field(default_factory=list)
    nonfinite: list[str] = field(default_factory=list)
    verified: int = 0
    bypassed: list[Bypass] = field(default_factory=list)

    @property
    def found(self) -> bool:
        """Whether this checkpoint found something wrong: replicas differing, or a gradient around its reduction
        (either ends the run with status 3)."""
        return bool(self.differences or self.bypassed)

    @property
    def finding(self) -> str:
        """What was found, in words."""
        said = []
        if self.differences:
            said.append("replicas differ")
        if self.bypassed:
            said.append("gradients bypassed their wrapper's reduction")
        return " and ".join(said) or "nothing"


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
    """The table of one checkpoint that found something: tensors differing and the worst by name; gradients that
    bypassed their wrapper's reduction, with the wrapper and how they arrived."""
    lines = []
    if checkpoint.differences:
        params = sorted({d.name for d in checkpoint.differences})
        lines += [
            f"wrapperroute audit, {checkpoint.label}: {len(params)} parameter(s) differ across replicas "
            f"({len(checkpoint.differences)} of {checkpoint.compared} tensors compared)",
            f"  {'max abs diff':>12}  {'of':<9} parameter",
        ]
        for difference in checkpoint.differences[:top]:
            lines.append(f"  {difference.describe():>12}  {difference.what:<9} {difference.name}")
        if len(checkpoint.differences) > top:
            lines.append(f"  ... and {len(checkpoint.differences) - top} more")
    if checkpoint.bypassed:
        lines += [
            f"wrapperroute audit, {checkpoint.label}: {len(checkpoint.bypassed)} sharded gradient(s) bypassed their "
            "wrapper's reduction (consistent across ranks, and wrong)",
            f"  {'wrapper':<15} {'on ranks':<9} parameter: how its gradient arrived",
        ]
        for bypass in checkpoint.bypassed[:top]:
            ranks = ",".join(map(str, bypass.ranks))
            lines.append(f"  {bypass.kind:<15} {ranks:<9} {bypass.name}: {bypass.how}")
        if len(checkpoint.bypassed) > top:
            lines.append(f"  ... and {len(checkpoint.bypassed) - top} more")
    return "\n".join(lines)


def final_line(audit: Audited, script_failed: str | None = None) -> str:
    """The one line rank 0 prints at the end: DESYNC, in sync, FAILED (the audit's own error), or nothing
    audited, with what was seen."""
    checkpoints = audit.checkpoints
    steps = sum(1 for c in checkpoints if c.label.startswith("step"))
    wrappers = ", ".join(sorted(audit.kinds)) or "none"
    bypassed = [(c.label, b) for c in checkpoints for b in c.bypassed]
    if bypassed and not any(c.differences for c in checkpoints):
        label, first_bypass = bypassed[0]
        names = {b.name for _, b in bypassed}
        line = (
            f"wrapperroute audit: BYPASSED ({steps} step(s) audited; {len(names)} sharded gradient(s) arrived around "
            f"their wrapper's reduction, first at {label}: {first_bypass.describe()}; wrappers: {wrappers}"
            f"{_alone(audit)})"
        )
    elif audit.desync:
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
    elif checkpoints and not any(c.compared or c.verified for c in checkpoints):
        line = (
            f"wrapperroute audit: in sync as far as can be seen ({steps} step(s) audited; nothing to compare or "
            f"watch: no trainable parameter has a copy on another rank, and these wrappers' shards fail loudly when "
            f"read outside their forward (ZeRO-3, FSDP1); wrappers: {wrappers}{_alone(audit)})"
        )
    elif checkpoints:
        compared = max(c.compared for c in checkpoints)
        line = (
            f"wrapperroute audit: in sync ({steps} step(s) audited, up to {compared} tensors compared per step, "
            f"0 parameters differing, worst 0{_verified(audit)}; wrappers: {wrappers}{_alone(audit)})"
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
    if bypassed and any(c.differences for c in checkpoints):
        label, first_bypass = bypassed[0]
        line += (f"; and {len({b.name for _, b in bypassed})} sharded gradient(s) arrived around their wrapper's "
                 f"reduction, first at {label}: {first_bypass.describe()}")  # fmt: skip
    if audit.desync and audit.failure is not None:
        line += f"; then the audit itself failed: {audit.failure}"
    return line + (f"; the script failed: {script_failed}" if script_failed else "")


def _verified(audit: Audited) -> str:
    """The sharded gradients checked to have come only through their wrapper's reduction, and at which steps:
    ``"; 21 sharded gradient(s) came only through their wrapper's reduction, at steps 2-3"``."""
    at = [c for c in audit.checkpoints if c.verified]
    if not at:
        return ""
    numbers = [c.label.removeprefix("step ") for c in at]
    first = int(numbers[0]) if numbers[0].isdigit() else 0
    if len(numbers) > 1 and numbers == [str(n) for n in range(first, first + len(numbers))]:
        steps = f"{numbers[0]}-{numbers[-1]}"
    else:
        steps = ", ".join(numbers)
    return (f"; up to {max(c.verified for c in at)} sharded gradient(s) per step came only through their wrapper's "
            f"reduction, checked at step(s) {steps}")  # fmt: skip


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
    differ = any(c.differences for c in audit.checkpoints)
    verdict = "desync" if differ else "bypassed" if audit.desync else "failed" if audit.failure else (
        "in sync" if audit.checkpoints else "nothing audited")  # fmt: skip
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
                    "sharded_verified": c.verified,
                    "bypassed": [
                        {"key": b.name, "wrapper": b.kind, "how": b.how, "ranks": list(b.ranks)} for b in c.bypassed
                    ],
                }
                for c in audit.checkpoints
            ],
        }
    )
