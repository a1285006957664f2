"""Security hygiene: no string execution or untrusted unpickling in the package, rank workers on
loopback only, and the CLI's workers cleaned up on Ctrl-C and on failure.

The rank pool unpickles only what its own spawned children send over their private pipes (and the children
only what their parent sends): no socket, file or user input is ever unpickled.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from wrapperroute.ranks import RankPool

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "wrapperroute"
FORBIDDEN = [
    (re.compile(r"(?<![\w.])eval\((?!\))"), "eval("),
    (re.compile(r"(?<![\w.])exec\((?!\))"), "exec("),
    (re.compile(r"pickle\.loads?\("), "pickle.load(s)"),
    (re.compile(r"marshal\.loads?\("), "marshal.load(s)"),
    (re.compile(r"yaml\.load\((?![^)]*SafeLoader)"), "yaml.load without SafeLoader"),
    (re.compile(r"torch\.load\((?![^)]*weights_only=True)"), "torch.load without weights_only=True"),
    (re.compile(r"shell=True"), "subprocess with shell=True"),
    (re.compile(r"os\.system\("), "os.system("),
]


def test_package_executes_no_strings_and_unpickles_nothing_untrusted() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 10, f"only {len(files)} files of the package found under {PACKAGE}"
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{number}: {what}"
        for path in files
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for pattern, what in FORBIDDEN
        if pattern.search(line.split("#", 1)[0])
    ]
    assert not found, found


def test_rank_workers_listen_on_loopback_only(pool: RankPool) -> None:
    pool.run(os.getpid)  # the pool is up and its group initialised
    addresses = set()
    for proc in pool._procs:
        for conn in psutil.Process(proc.pid).net_connections(kind="inet"):
            addresses.add(conn.laddr.ip)
            if conn.raddr:
                addresses.add(conn.raddr.ip)
    assert addresses, "gloo should hold sockets between the ranks"
    assert addresses <= {"127.0.0.1", "::1"}, addresses


def _start_check(*extra: str) -> tuple[subprocess.Popen[str], list[psutil.Process]]:
    cli = subprocess.Popen(
        [sys.executable, "-m", "wrapperroute", "check", "--wrappers", "ddp", "--losses", "fused_ce", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ,
        # A shell starting pytest in the background ignores SIGINT, and children inherit that: restore the
        # default, so the CLI installs Python's KeyboardInterrupt handler as it would in a terminal.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    parent = psutil.Process(cli.pid)
    deadline = time.monotonic() + 120
    workers: list[psutil.Process] = []
    while time.monotonic() < deadline and len(workers) < 2 and cli.poll() is None:
        workers = [p for p in parent.children(recursive=True) if "resource_tracker" not in " ".join(p.cmdline())]
        time.sleep(0.2)
    return cli, workers


def _gone(workers: list[psutil.Process], seconds: float = 15) -> list[int]:
    _, alive = psutil.wait_procs(workers, timeout=seconds)
    return [p.pid for p in alive]


def test_cli_ctrl_c_exits_and_leaves_no_worker() -> None:
    # Enough steps that the run is still going when the signal arrives (50 steps finish within a second).
    cli, workers = _start_check("--steps", "100000")
    assert len(workers) >= 2, "the CLI should have spawned its rank workers"
    time.sleep(1.0)
    assert cli.poll() is None, "the run ended before it could be interrupted"
    cli.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C delivers to the foreground process
    _, err = cli.communicate(timeout=60)
    try:
        assert cli.returncode == 130, err[-2000:]
        assert "interrupted" in err, f"Ctrl-C is not said: {err[-2000:]}"
        assert not _gone(workers), "worker processes left behind"
    finally:
        for p in workers:
            if p.is_running():
                p.kill()


def test_cli_failure_leaves_no_worker() -> None:
    """A cell that cannot finish (a 1 ms budget): reported as failed, exit 1, every worker gone."""
    cli, workers = _start_check("--timeout", "0.001")
    _, err = cli.communicate(timeout=180)
    try:
        assert cli.returncode == 1, err[-2000:]
        assert workers and not _gone(workers), "worker processes left behind"
    finally:
        for p in workers:
            if p.is_running():
                p.kill()


@pytest.mark.parametrize("name", ["ranks.py"])
def test_pool_binds_loopback_by_configuration(name: str) -> None:
    text = (PACKAGE / name).read_text()
    assert '"GLOO_SOCKET_IFNAME": "lo"' in text, f"{name} does not pin gloo to the loopback interface"
    assert "FileStore" in text and "TCPStore" not in text, f"{name} does not rendezvous through a FileStore only"
