"""The rank pool itself (wrapperroute/ranks.py): what its users see when it exits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = """
from wrapperroute.ranks import RankPool
import holder

if __name__ == "__main__":
    with RankPool(2) as pool:
        print("results", pool.run(holder.hold_a_lock))
"""

HOLDER = """
import multiprocessing

HELD = []

def hold_a_lock():
    # What tqdm does on first use in a rank (compiled Liger losses reach it): a named semaphore kept for
    # the process's life, registered with the resource tracker the rank shares with its parent.
    HELD.append(multiprocessing.get_context("spawn").RLock())
    return len(HELD)
"""


def test_pool_exit_leaves_no_leaked_semaphore_warning(tmp_path: Path) -> None:
    # Ranks leave through os._exit (the shutdown abort); that skipped the semaphores' finalizers, and every
    # `wrapperroute check` that compiled a Liger loss ended with the tracker's "leaked semaphore" warning.
    (tmp_path / "holder.py").write_text(textwrap.dedent(HOLDER))
    (tmp_path / "main.py").write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "main.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert "results [1, 1]" in done.stdout, (done.stdout, done.stderr)
    assert "leaked semaphore" not in done.stderr, done.stderr
    assert done.returncode == 0, done.stderr


BODY = """
def checks(limit):
    value = 3
    assert value < limit, f"value {value} reached the limit {limit}"
    return value
"""

FAILING_TEST = """
import body
from wrapperroute.ranks import RankPool


def test_a_rank_asserts():
    with RankPool(2) as pool:
        pool.run(body.checks, 2)
"""


def test_a_failed_assertion_in_a_rank_points_at_its_line(tmp_path: Path) -> None:
    """A test whose rank body asserts falsely: pytest's report names the body's file and line, the assertion's
    source and its message, as for an assertion in the test itself."""
    (tmp_path / "body.py").write_text(textwrap.dedent(BODY))
    (tmp_path / "test_harness.py").write_text(textwrap.dedent(FAILING_TEST))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_harness.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)  # fmt: skip
    assert done.returncode == 1, done.stdout[-3000:]
    line = f"{tmp_path / 'body.py'}:4: assert value < limit"
    assert f"RankAssertionError: rank 0: {line}" in done.stdout, done.stdout[-3000:]
    assert "value 3 reached the limit 2" in done.stdout, done.stdout[-3000:]
