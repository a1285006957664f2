"""What the command line shares: its usage error, the rank workers' environment, and error text cut to size."""

from __future__ import annotations

import sys

from .extensions import cache_env, clear_stale_locks


class UsageError(Exception):
    pass


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


def rank_env(verbose: bool) -> dict[str, str]:
    return {**cache_env(), **({} if verbose else QUIET_ENV)}


def say_stale_locks(env: dict[str, str]) -> None:
    """Clear the C++ extension build locks no process holds in the ranks' extensions folder, and say what was
    found there (a lock held by a live build, or one whose holder cannot be told): never a silent wait."""
    for line in clear_stale_locks(env["TORCH_EXTENSIONS_DIR"]):
        print(f"wrapperroute: {line}", file=sys.stderr, flush=True)


def last_error_line(text: str) -> str:
    """The exception line of a traceback (Dynamo appends advice after it)."""
    lines = [line.strip() for line in text.strip().splitlines()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Failed")) and " " not in head:
            return line
    return lines[-1]


def cut(text: str, width: int) -> str:
    """``text`` cut at a word boundary to at most ``width`` characters (``--json`` keeps all of it)."""
    if len(text) <= width:
        return text
    return text[: width - 3].rsplit(" ", 1)[0] + " ..."
