"""``wrapperroute audit [OPTIONS] (SCRIPT | -m MODULE) [ARGS...]``: run a training script unmodified, on every
rank its launcher started, and report whether its data-parallel replicas stayed in sync.

Exit status: 0 when every audited step was in sync (or nothing could be audited, said in the final line);
3 when a desync was found, whatever the script returned; 4 when the audit itself failed (the script ran on,
unaudited; the final line says why) and the script ended well; otherwise the script's own (1 for an
exception it raised, 130 for Ctrl-C, its ``sys.exit`` code). The process ends with that status every time: after
the script's exit handlers, without the interpreter teardown that gloo aborts.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import runpy
import sys
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

from .session import AUDIT_FAILED_EXIT, DESYNC_EXIT, Audit, AuditDesyncError, DesyncExit, OnDesync, rank

USAGE = (
    "usage: wrapperroute audit [--steps K|all] [--json PATH] [--on-desync exit|raise|warn] "
    "(SCRIPT | -m MODULE) [ARGS...]"
)
DEFAULT_STEPS = 3


class AuditUsageError(Exception):
    pass


@dataclass
class Options:
    steps: int | None = DEFAULT_STEPS
    json_path: str | None = None
    on_desync: OnDesync = "exit"
    module: str | None = None
    script: str | None = None
    args: list[str] = field(default_factory=list)


def parse(argv: list[str]) -> Options:
    """Options up to SCRIPT (or ``-m MODULE``); everything after belongs to the script, untouched."""
    options = Options()
    rest = list(argv)
    while rest:
        head = rest.pop(0)
        if head in ("-h", "--help"):
            raise AuditUsageError(USAGE)
        if head in ("--steps", "--json", "--on-desync", "-m"):
            if not rest:
                raise AuditUsageError(f"{head} needs a value; {USAGE}")
            value = rest.pop(0)
            if head == "--steps":
                options.steps = _steps(value)
            elif head == "--json":
                options.json_path = value
            elif head == "--on-desync":
                if value not in ("exit", "raise", "warn"):
                    raise AuditUsageError(f"--on-desync takes exit, raise or warn, got {value!r}")
                options.on_desync = value  # type: ignore[assignment]
            else:
                options.module = value
                break
        elif head.startswith("-"):
            raise AuditUsageError(f"unknown option {head!r}; {USAGE}")
        else:
            options.script = head
            break
    if options.script is None and options.module is None:
        raise AuditUsageError(f"no script to run; {USAGE}")
    if options.script is not None and not os.path.isfile(options.script):
        raise AuditUsageError(f"no such script: {options.script}")
    options.args = rest
    return options


def _steps(value: str) -> int | None:
    if value == "all":
        return None
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise AuditUsageError(f"--steps takes a positive number or 'all', got {value!r}")


def main(argv: list[str], leave: bool = False) -> int:
    """Run the audited script; its status. ``leave``: end the process with that status once the script, the final
    comparison and the exit handlers are done (the program's own entry point), see :func:`_leave`."""
    try:
        options = parse(argv)
    except AuditUsageError as error:
        print(f"wrapperroute audit: error: {error}", file=sys.stderr)
        return 2
    audit = Audit(options.steps, options.on_desync, options.json_path)
    audit.install()
    status, failure = _run(options)
    try:
        if failure is None and status in (0, DESYNC_EXIT):
            audit.finish()  # every rank got here: the last comparison is safe to run
    except (DesyncExit, AuditDesyncError):
        pass  # the end comparison found replicas differing: recorded, reported below with status 3
    finally:
        audit.uninstall()
    if audit.desync:
        status = DESYNC_EXIT
    elif audit.failure is not None and status == 0:
        status = AUDIT_FAILED_EXIT
    final = audit.final_line(failure)
    if rank() == 0:
        sys.stdout.write(final + "\n")  # one write: other ranks' output cannot land inside the line
        sys.stdout.flush()
        audit.write_json(final, status)
    if leave:  # every rank ends here together with these statuses: none is left waiting at the barrier
        _leave(status, together=status in (0, DESYNC_EXIT, AUDIT_FAILED_EXIT))
    return status


def _together(seconds: float = 60.0) -> None:
    """Wait until every rank is done (bounded: a barrier on the audit's own gloo group, if it made one). torchrun
    stops every other rank (SIGTERM) as soon as one ends with a failing status, 3 included: a rank leaving first
    would have the others stopped before rank 0's final line, or their own status, is out."""
    import torch.distributed as dist

    from .._groups import made_side_group, world_size

    if world_size() < 2:
        return
    side = made_side_group(backend="gloo")
    if side is not None:
        with contextlib.suppress(Exception):  # a rank that never comes: leave anyway, once the wait is over
            dist.monitored_barrier(group=side, timeout=timedelta(seconds=seconds), wait_all_ranks=True)


def _leave(status: int, together: bool) -> None:
    """End the process with ``status``, every time. The script's exit handlers run (``atexit``: its own, the
    libraries', logging's) and the output is flushed, as at a normal exit; the interpreter's teardown, which
    torch 2.13's gloo can abort ("terminate called without an active exception", with or without
    ``destroy_process_group``, with or without the audit), does not run, so the launcher reads the status the
    run earned, not SIGABRT. ``together``: every rank leaves at once, after the others' exit
    handlers too (see :func:`_together`)."""
    try:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        if together:
            _together()
    finally:
        os._exit(status)


def _run(options: Options) -> tuple[int, str | None]:
    """Run the script as ``__main__``; its exit status and, if it failed, why."""
    target = options.script if options.script is not None else options.module
    assert target is not None
    sys.argv = [target, *options.args]
    try:
        if options.module is not None:
            runpy.run_module(options.module, run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(target)
            sys.path.insert(0, os.path.dirname(script))  # as ``python script.py`` does
            runpy.run_path(script, run_name="__main__")
    except DesyncExit:
        return DESYNC_EXIT, None
    except SystemExit as done:
        code = done.code
        if code is None or isinstance(code, int):
            return code or 0, None if not code else f"exit status {code}"
        print(code, file=sys.stderr)  # sys.exit("message"): Python prints it and exits 1
        return 1, f"exit status 1 ({code})"
    except KeyboardInterrupt:
        return 130, "interrupted (Ctrl-C)"
    except AuditDesyncError as error:  # --on-desync raise, not handled by the script
        print(f"wrapperroute audit: {error}", file=sys.stderr)
        return DESYNC_EXIT, None
    except BaseException as error:
        traceback.print_exc()
        return 1, f"{type(error).__name__}: {error}"
    return 0, None
