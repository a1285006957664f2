"""A pool of local CPU ranks on gloo, spawned once and reused: the test suite's and the CLI's launcher.

Each worker joins one gloo process group through a ``FileStore`` (no TCP store to expose) with gloo pinned to
the loopback interface, then runs the tasks it is sent, one at a time. A task is a module-level function
(pickled by reference) called on every rank; its return values come back in rank order.

Robust to the ways CPU gloo runs go wrong here:
- a rank that raises: every rank's traceback is reported and the pool restarts (a collective may be half done);
- a rank that hangs: the task times out, the workers are killed and the pool restarts on the next task;
- the occasional abort at interpreter shutdown: workers leave through ``os._exit`` after tearing down the
  group, and results are judged by what the ranks sent, never by exit codes;
- a parent that dies (Ctrl-C, kill): workers notice within a second and exit.

Only our own child processes are ever unpickled, over their private pipes.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

DEFAULT_ENV = {
    "DS_ACCELERATOR": "cpu",  # DeepSpeed on CPU: gloo, no oneCCL
    "GLOO_SOCKET_IFNAME": "lo",  # gloo's pairs bind to loopback only
    "MASTER_ADDR": "127.0.0.1",
    "OMP_NUM_THREADS": "1",  # N ranks share the cores; oversubscription makes CPU runs erratic
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
}


class RankFailure(RuntimeError):
    """A task raised on at least one rank, or did not finish in time."""

    def __init__(self, message: str, errors: dict[int, str]) -> None:
        super().__init__(message)
        self.errors = errors


class RankAssertionError(RankFailure, AssertionError):
    """An assertion failed inside a rank: its message opens with the rank, the file and line of the ``assert``
    statement (see ``_assertion``) and its source, so a test runner's report points at the line where the fact
    was computed; the rank's whole traceback follows."""


def _assertion(error: AssertionError) -> str:
    """``file:line: source: message`` of the ``assert`` statement (the innermost frame that is one; else the
    innermost frame, for an ``AssertionError`` raised by a helper such as ``torch.testing.assert_close``)."""
    frames = traceback.extract_tb(error.__traceback__)
    frame = next((f for f in reversed(frames) if (f.line or "").lstrip().startswith("assert ")), frames[-1])
    message = str(error)
    return f"{frame.filename}:{frame.lineno}: {frame.line}" + (f": {message}" if message else "")


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(1.0)


def _worker(rank: int, world_size: int, store_path: str, conn: Connection, env: dict[str, str]) -> None:
    # Results travel over the pipe; what libraries print (DeepSpeed's build and config chatter) goes to
    # stderr, so the parent's stdout stays its own (``wrapperroute check --json`` prints one JSON object).
    os.dup2(2, 1)
    os.environ.update(env)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    threading.Thread(target=_watch_parent, args=(int(env["WRAPPERROUTE_PARENT_PID"]),), daemon=True).start()
    if env.get("WRAPPERROUTE_QUIET") == "1":
        # A CLI's ranks: what libraries print (warnings, log lines, DeepSpeed's build messages) would land in the
        # middle of its progress lines. Results and errors travel over the pipe, not through these streams.
        import logging
        import warnings

        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, 1)
        os.dup2(quiet, 2)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = timedelta(seconds=float(env.get("WRAPPERROUTE_COLLECTIVE_TIMEOUT", "120")))
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message is None:
            break
        fn, args, kwargs = message
        try:
            reply: tuple[str, Any] = ("ok", fn(*args, **kwargs))
        except AssertionError as error:  # where the failing fact was computed, and the whole traceback
            reply = ("assert", (_assertion(error), traceback.format_exc()))
        except BaseException:
            reply = ("err", traceback.format_exc())
        try:
            conn.send(reply)
        except Exception:
            conn.send(("err", traceback.format_exc()))
    try:
        dist.destroy_process_group()
        # Named semaphores made in this rank (tqdm's lock, which compiled losses create) are unregistered from
        # the resource tracker shared with the parent only by these finalizers; os._exit skips them, and the
        # tracker then warns of "leaked semaphore objects" when the parent exits.
        from multiprocessing import util

        util._run_finalizers()  # type: ignore[attr-defined]
    finally:
        os._exit(0)  # skip interpreter teardown: it is where the shutdown abort happens


class RankPool:
    """``world_size`` local gloo ranks. Use as a context manager, or call :meth:`close`."""

    def __init__(self, world_size: int = 2, env: dict[str, str] | None = None, start_timeout: float = 180.0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.env = {**DEFAULT_ENV, **(env or {})}
        self.start_timeout = start_timeout
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.restarts = 0

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory(prefix="wrapperroute-ranks-")
        store_path = os.path.join(self._tmp.name, "store")
        env = {**self.env, "WRAPPERROUTE_PARENT_PID": str(os.getpid())}
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, self.world_size, store_path, child_end, env), daemon=True)
            proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)
        deadline = time.monotonic() + self.start_timeout
        for rank, conn in enumerate(self._conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                self.close()
                raise RankFailure(f"rank {rank} did not start within {self.start_timeout:.0f}s", {})
            conn.recv()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        if not self.alive:
            if self._procs:
                self.restarts += 1
            self.close()
            self.start()
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        assertions: dict[int, str] = {}
        for rank, conn in enumerate(self._conns):
            try:
                ready = conn.poll(max(0.0, deadline - time.monotonic()))
                if not ready:
                    errors[rank] = f"no answer within {timeout:.0f}s"
                    continue
                status, value = conn.recv()
            except (EOFError, OSError):
                errors[rank] = "the rank process died"
                continue
            if status == "assert":
                assertions[rank], value = value
            (results if status == "ok" else errors)[rank] = value
        if errors:
            self.close()  # a collective may be half done: never reuse that group
            detail = "\n".join(f"--- rank {r}:\n{e}" for r, e in sorted(errors.items()))
            name = getattr(fn, "__qualname__", repr(fn))
            if assertions:  # the first rank's failed assertion first: where the test's fact was found wrong
                first = min(assertions)
                raise RankAssertionError(f"rank {first}: {assertions[first]}\n{name} failed on rank(s) "
                                         f"{sorted(errors)}:\n{detail}", errors)  # fmt: skip
            raise RankFailure(f"{name} failed on rank(s) {sorted(errors)}:\n{detail}", errors)
        return [results[r] for r in range(self.world_size)]

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.send(None)
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> RankPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
