"""The C++ extension build lock a killed build leaves behind: torch's loader waits on it forever without a word;
``wrapperroute check`` clears it within seconds, says so, and goes on. A lock a live build holds is left alone
and named."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CACHE, REPO

from wrapperroute.check.extensions import cache_env, clear_stale_locks

NEEDS_DS = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
BUILT = CACHE / "torch_extensions" / "deepspeed_shm_comm"  # the suite's own build of DeepSpeed's op


def _extensions_with_stale_lock(tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "torch_extensions"
    if BUILT.is_dir():  # a copy of the built op: the run loads it instead of building it for a minute
        shutil.copytree(BUILT, root / BUILT.name)
    lock = root / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()  # what a build killed midway leaves: nobody holds it
    return root, lock


@NEEDS_DS
def test_torch_waits_on_a_stale_lock_silently(tmp_path: Path) -> None:
    """The premise: DeepSpeed's op load, given a stale lock, is still waiting after 12 s, having said nothing."""
    root, lock = _extensions_with_stale_lock(tmp_path)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root), "DS_ACCELERATOR": "cpu"}
    code = "from deepspeed.comm.torch import build_shm_op; build_shm_op(); print('loaded')"
    with pytest.raises(subprocess.TimeoutExpired) as waited:
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=12)
    assert "loaded" not in str(waited.value.stdout or b""), "the op loaded despite the stale lock"
    assert lock.exists(), "the stale lock is gone: the premise does not hold"


@NEEDS_DS
def test_check_clears_a_stale_lock_and_goes_on(tmp_path: Path) -> None:
    root, lock = _extensions_with_stale_lock(tmp_path)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root), "PYTHONPATH": str(REPO)}
    start = time.monotonic()
    command = [sys.executable, "-m", "wrapperroute", "check", "--wrappers", "zero2", "--losses", "fused_ce"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    said = [line for line in done.stderr.splitlines() if "stale C++ extension build lock" in line]
    assert said and str(lock) in said[0], done.stderr[-3000:]
    assert done.returncode == 0 and "every routed cell exact" in done.stdout, done.stdout + done.stderr[-3000:]
    assert time.monotonic() - start < 400, f"check took {time.monotonic() - start:.0f} s"


def test_a_lock_held_open_is_named_not_removed(tmp_path: Path) -> None:
    lock = tmp_path / "ext" / "lock"
    lock.parent.mkdir()
    lock.touch()
    code = f"f = open({str(lock)!r}); print('open', flush=True); import time; time.sleep(60)"
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None, "the holder's output is not piped"
        opened = holder.stdout.readline().strip()
        assert opened == "open", f"the holder did not open the lock (a build holds its lock): {opened!r}"
        said = clear_stale_locks(str(tmp_path))
        assert said and f"waiting for {lock}: process {holder.pid}" in said[0], said
        assert lock.exists(), "a lock held open was removed"
    finally:
        holder.kill()
        holder.wait()
    said = clear_stale_locks(str(tmp_path))
    assert "removed" in said[0] and not lock.exists(), f"the lock, no longer held, is not removed: {said}"


def test_the_default_folder_is_keyed_by_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    folder = cache_env()["TORCH_EXTENSIONS_DIR"]
    versions = f"torch{torch.__version__}", f"py{sys.version_info.major}{sys.version_info.minor}"
    assert all(version in folder for version in versions), f"the default folder {folder} is not keyed by {versions}"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/somewhere/mine")
    chosen = cache_env()["TORCH_EXTENSIONS_DIR"]
    assert chosen == "/somewhere/mine", f"the folder the user chose became {chosen}"


def test_other_users_processes_are_not_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """/proc as a non-root user sees it (simulated: this machine runs as root): another user's open files are
    unreadable. They are skipped, so a stale lock in this user's cache is still found and removed; before, one
    unreadable process made every lock "cannot tell"."""
    import os

    lock = tmp_path / "ext" / "lock"
    lock.parent.mkdir()
    lock.touch()
    user = 54321  # a user owning no process here
    listdir = os.listdir

    def as_that_user(path: str) -> list[str]:
        if path.startswith("/proc/") and path.endswith("/fd") and os.stat(path[: -len("/fd")]).st_uid != user:
            raise PermissionError(13, "Permission denied", path)
        return listdir(path)

    monkeypatch.setattr(os, "getuid", lambda: user)
    monkeypatch.setattr(os, "listdir", as_that_user)
    said = clear_stale_locks(str(tmp_path))
    assert said and "removed" in said[0] and not lock.exists(), said
