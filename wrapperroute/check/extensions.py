"""The compile caches the check's ranks share, and torch's C++ extension build locks in them.

DeepSpeed builds a C++ communication op on its first use, through torch's extension loader, into
``TORCH_EXTENSIONS_DIR``. Two things go wrong with one shared folder:

- a build for one torch or DeepSpeed release is not a build for another, so two environments sharing the folder
  rebuild it in turn: the default folder is keyed by the Python version, torch's build and DeepSpeed's version;
- the loader takes a ``lock`` file for the length of a build (``torch.utils.file_baton.FileBaton``), and a
  process killed while building leaves it behind: every later load waits on it forever, saying nothing. A
  builder holds its lock file open, so a lock that no process holds open is stale: it is removed, and said.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Iterator

LOCK_NAME = "lock"  # what torch's extension loader calls its build lock, in each extension's build folder


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def cache_env() -> dict[str, str]:
    """The caches every rank of a check or benchmark shares: the inductor cache, and a C++ extensions folder
    keyed by the versions that make a build different. Folders the user set are kept as they are."""
    base = os.path.join(os.path.expanduser("~"), ".cache", "wrapperroute")
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    # torch's build, not its release: a CPU and a CUDA wheel of one release (2.15.0+cpu, 2.15.0+cu132) link
    # different libraries, and only torch.__version__ tells them apart (a wheel's metadata may say 2.15.0)
    import torch

    key = f"{python}-torch{torch.__version__}-deepspeed{_version('deepspeed')}"
    return {
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", os.path.join(base, "inductor")),
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", os.path.join(base, "torch_extensions", key)),
    }


def build_locks(root: str) -> Iterator[str]:
    """Every build lock file under ``root`` (one per extension's build folder)."""
    if not os.path.isdir(root):
        return
    for folder, _, files in os.walk(root):
        if LOCK_NAME in files and folder.count(os.sep) - root.count(os.sep) <= 2:
            yield os.path.join(folder, LOCK_NAME)


def holders(path: str) -> list[int] | None:
    """The processes holding ``path`` open, or None when this system cannot tell (no ``/proc``, or a process
    of this user's whose open files it may not read). Other users' processes are not asked: their open files
    are unreadable to a non-root user, and a build in this user's cache is this user's."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    target = os.path.realpath(path)
    uid = os.getuid()
    found: list[int] = []
    unknown = False
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fds = f"/proc/{entry}/fd"
        try:
            if uid != 0 and os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            names = os.listdir(fds)
        except PermissionError:
            unknown = True
            continue
        except OSError:  # the process ended meanwhile
            continue
        for name in names:
            try:
                if os.readlink(f"{fds}/{name}") == target:
                    found.append(int(entry))
                    break
            except OSError:
                continue
    return None if unknown and not found else found


def clear_stale_locks(root: str) -> list[str]:
    """Remove the build locks under ``root`` that no process holds, and say what was found: one line per lock
    (removed, held by whom, or left because this system cannot tell who holds it)."""
    said = []
    for lock in build_locks(root):
        held_by = holders(lock)
        if held_by == []:
            try:
                os.remove(lock)
            except FileNotFoundError:  # its builder finished meanwhile
                continue
            said.append(f"removed a stale C++ extension build lock, {lock}: no process held it (a build killed "
                        "midway left it; the extension is built again)")  # fmt: skip
        elif held_by:
            pids = ", ".join(str(pid) for pid in held_by)
            said.append(f"waiting for {lock}: process {pids} is building that C++ extension (DeepSpeed's cells "
                        "wait for it)")  # fmt: skip
        else:
            said.append(f"{lock} exists and this system cannot tell who holds it: DeepSpeed's cells wait for it "
                        "until it is removed; remove it if no build is running")  # fmt: skip
    return said
