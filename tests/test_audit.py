"""``wrapperroute audit`` end to end: unmodified scripts under real launchers (torchrun, accelerate launch),
real wrappers, real TRL and HF trainers. The final line, each rank's exit status and the table are what a
user and a CI job read, so they are what is checked."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

from wrapperroute.ranks import RankPool

SCRIPTS = REPO / "tests" / "audit_scripts"
HAS = {name: importlib.util.find_spec(name) is not None for name in ("deepspeed", "trl", "liger_kernel", "accelerate")}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "DS_ACCELERATOR": "cpu",
       "MASTER_ADDR": "127.0.0.1", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}  # fmt: skip


# Seen once in ~30 launches here: gloo's TCP pair to another rank closed while the ranks were still setting up
# (in DDP's first collective), before the audit compared anything. Judged by what the ranks report: rerun.
TRANSPORT_FAILURE = "gloo/transport/tcp/pair.cc"


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


def _run(command: list[str], timeout: float = 240) -> dict[str, Any]:
    # Own session: on a timeout the launcher and its ranks are killed, never left running.
    proc = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{command} timed out:\n{out[-3000:]}\n{err[-3000:]}")
    finals = re.findall(r"wrapperroute audit: (?:in sync|DESYNC|BYPASSED|nothing audited)[^\n]*", out)
    # torchrun reports each failed rank's status; the launcher itself exits 1 when any rank failed
    statuses = [int(code) for code in re.findall(r"exitcode\s*:\s*(-?\d+)", err)]
    return {"code": proc.returncode, "out": out, "err": err, "final": finals, "rank_codes": statuses}


def _audit(nproc: int, script: str, *args: str, audit: tuple[str, ...] = ()) -> dict[str, Any]:
    command = _torchrun(nproc, "-m", "wrapperroute", "audit", *audit, str(SCRIPTS / script), *args)
    run = _run(command)
    if TRANSPORT_FAILURE in run["out"] + run["err"] and any("nothing audited" in line for line in run["final"]):
        run = _run(command)  # gloo's loopback transport dropped a pair before training began: once more
    return run


def _one_final(run: dict[str, Any]) -> str:
    assert len(run["final"]) == 1, (run["out"][-3000:], run["err"][-3000:])  # rank 0 only, once
    return str(run["final"][0])


def test_desync_found_and_in_sync_passes(tmp_path: Path) -> None:
    """The plain DDP script whose fused loss reads model.module: DESYNC, the table, rank status 3. The same
    script routed: in sync, 0, and its losses bit-identical to a run without the audit."""
    report = tmp_path / "audit.json"
    bad = _audit(2, "ddp_train.py", "--loss", "module", audit=("--json", str(report)))
    final = _one_final(bad)
    written = json.loads(report.read_text())
    assert written["verdict"] == "desync" and written["exit_status"] == 3 and written["final_line"] == final, (
        f"the report written: {written}; the final line printed: {final}"
    )
    start, first = written["checkpoints"][:2]  # the parameters before anything stepped, then step 1
    assert start["label"] == "before step 1" and not start["differences"] and first["label"] == "step 1", written
    assert first["differences"][0]["key"] == "ddp[0].lm_head.weight", written
    assert final.startswith("wrapperroute audit: DESYNC") and "first at step 1" in final, final
    assert "ddp[0].lm_head.weight (gradient)" in final, final
    assert "6 parameter(s) differ across replicas" in bad["out"] and "gradient  ddp[0]" in bad["out"], bad["out"]
    assert bad["code"] != 0 and 3 in bad["rank_codes"], bad["err"][-2000:]
    good = _audit(2, "ddp_train.py", "--loss", "routed", "--steps", "5", audit=("--steps", "all"))
    assert _one_final(good).startswith("wrapperroute audit: in sync (5 step(s) audited"), good["out"]
    assert good["code"] == 0, good["err"][-2000:]
    _assert_same_losses(good)


def _assert_same_losses(audited: dict[str, Any]) -> None:
    """Losses bit-identical (float.hex) with and without the audit (which audited every step)."""
    # --leave: the plain run skips the interpreter's teardown, where torch 2.13's gloo aborts about 3 exits in 10
    plain = _run(_torchrun(2, str(SCRIPTS / "ddp_train.py"), "--loss", "routed", "--steps", "5", "--leave"))
    assert plain["code"] == 0, plain["err"][-2000:]

    def losses(out: str) -> list[tuple[str, ...]]:  # two ranks' lines can interleave on the launcher's stdout
        return sorted(re.findall(r"rank (\d+) step (\d+) loss (-?0x[0-9a-f.]+p[+-]\d+)", out))

    assert len(losses(plain["out"])) == 10, f"the plain run printed {len(losses(plain['out']))} losses, not 10"
    assert losses(plain["out"]) == losses(audited["out"]), "the audited run's losses differ from the plain run's"


@pytest.mark.parametrize(
    ("nproc", "script", "args", "wrapper"),
    [
        pytest.param(2, "ddp_train.py", ("--accum", "3"), "ddp", id="ddp-no_sync"),
        pytest.param(2, "zoo.py", ("--setup", "replicate"), "replicate", id="replicate"),
        pytest.param(2, "zoo.py", ("--setup", "zero2"), "deepspeed", id="zero2",
                     marks=pytest.mark.skipif(not HAS["deepspeed"], reason="deepspeed is not installed")),
        pytest.param(4, "zoo.py", ("--setup", "hsdp"), "fsdp2", id="fsdp2-hsdp-4ranks"),
        pytest.param(2, "zoo.py", ("--setup", "zero3"), "deepspeed", id="zero3",
                     marks=pytest.mark.skipif(not HAS["deepspeed"], reason="deepspeed is not installed")),
    ],
)  # fmt: skip
def test_no_false_alarm(nproc: int, script: str, args: tuple[str, ...], wrapper: str) -> None:
    """In sync, 0. ZeRO-3 partitions every parameter, has no copy to compare and leaves no silent route around
    its reduction (tests/test_sharded.py): the final line says in sync as far as can be seen, and why."""
    run = _audit(nproc, script, *args, audit=("--steps", "all"))
    final = _one_final(run)
    assert final.startswith("wrapperroute audit: in sync") and f"wrappers: {wrapper}" in final, final
    if "zero3" in args:
        assert "as far as can be seen" in final and "6 sharded" in final, final
    else:
        assert f"wrappers: {wrapper})" in final, final
    assert run["code"] == 0, run["err"][-3000:]


@pytest.mark.skipif(not (HAS["trl"] and HAS["liger_kernel"]), reason="trl and liger-kernel are not installed")
@pytest.mark.parametrize("trainer", ["dpo", "hf"])
def test_real_trainers(trainer: str, tmp_path: Path) -> None:
    """TRL's DPOTrainer with use_liger_kernel=True and an HF Trainer with a fused compute_loss, as written: the
    audit's verdict is the truth the script measures by gathering every parameter (DESYNC where they differ: the
    HF trainer always, TRL's DPO up to 1.13; in sync where TRL runs the loss inside the model, 1.14
    on). Where it desyncs, with patch_trl() / @routed: in sync, and the truth says so."""
    folder = tmp_path / "model"
    folder.mkdir()
    # warned, not ended at the desync: the script runs to its end and measures the truth
    bad = _audit(2, "hf_trl.py", "--trainer", trainer, "--folder", str(folder), audit=("--on-desync", "warn"))
    differing = _truth(bad)
    print(f"\n{trainer} as written: {differing} parameter(s) differ across ranks; {_one_final(bad)[:40]}")
    if trainer == "hf":  # the bug shown: a loss reading lm_head.weight outside DDP's forward
        assert differing > 0, bad["out"][-2000:]
    if differing:
        assert _one_final(bad).startswith("wrapperroute audit: DESYNC"), bad["out"][-2000:] + bad["err"][-3000:]
        assert 3 in bad["rank_codes"], f"no rank left with the desync status 3: {bad['rank_codes']}"
    else:
        assert _one_final(bad).startswith("wrapperroute audit: in sync"), bad["out"][-2000:] + bad["err"][-3000:]
        return  # nothing for the fix to show (patch_trl on every trainer: tests/test_trl.py)
    good = _audit(2, "hf_trl.py", "--trainer", trainer, "--fix", "--folder", str(folder))
    assert _truth(good) == 0, good["out"][-2000:]
    assert _one_final(good).startswith("wrapperroute audit: in sync"), good["out"][-2000:] + good["err"][-3000:]
    assert good["code"] == 0, f"the fixed run exited {good['code']}: {good['err'][-2000:]}"


def _truth(run: dict[str, Any]) -> int:
    """How many parameters differed across the ranks at the end of an ``hf_trl.py`` run, as it measured them."""
    found = re.findall(r"^truth: (\d+) parameter\(s\) differ across ranks$", run["out"], re.MULTILINE)
    assert len(found) == 1, f"the script's truth line, once: {run['out'][-2000:]}"
    return int(found[0])


@pytest.mark.parametrize("launcher", ["accelerate", "deepspeed"])
def test_through_other_launchers(launcher: str) -> None:
    """accelerate launch -m, and the deepspeed launcher's --module mode (which puts --local_rank=N first)."""
    pytest.importorskip(launcher, reason=f"{launcher} is optional: pip install wrapperroute[{launcher}]")
    script = [str(SCRIPTS / "ddp_train.py"), "--loss", "module"]
    if launcher == "accelerate":  # this interpreter's launchers, never another environment's from PATH
        # --multi_gpu selects accelerate's torchrun launcher (--cpu would start one process); the script's own
        # init_process_group("gloo") then runs on CPU
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                   "--num_machines", "1",
                   "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_port()), "-m",
                   "wrapperroute", "audit", *script]  # fmt: skip
    else:
        command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(_port()),
                   "--module", "wrapperroute", "audit",
                   *script]  # fmt: skip
    run = _run(command)
    assert _one_final(run).startswith("wrapperroute audit: DESYNC"), run["out"][-2000:] + run["err"][-2000:]
    assert run["code"] != 0, "the desynced run exited 0"


@pytest.mark.parametrize(
    ("case", "code", "words"),
    [
        ("raises", 1, "the script failed: ValueError: the script's own failure at step 0"),
        ("exit7", 7, "the script failed: exit status 7"),
        ("nothing", 0, "nothing audited (no optimizer step ran)"),
    ],
)
def test_script_outcomes_kept(case: str, code: int, words: str) -> None:
    run = _audit(2, "small.py", "--case", case)
    assert words in _one_final(run), run["out"]
    assert (run["code"] == 0) == (code == 0), f"the audit exited {run['code']}, the script {code}"
    if code:
        assert code in run["rank_codes"], run["err"][-2000:]
    if case == "raises":
        # its own traceback, as Python prints it
        assert "ValueError: the script's own failure" in run["err"], f"no traceback of its own: {run['err'][-2000:]}"


def test_ctrl_c_ends_every_rank() -> None:
    command = _torchrun(2, "-m", "wrapperroute", "audit", "--steps", "all", str(SCRIPTS / "small.py"), "--case",
                        "sleep")  # fmt: skip
    proc = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    assert proc.stdout is not None, "torchrun's output is not piped"
    seen = 0
    deadline = time.monotonic() + 120
    while seen < 4 and time.monotonic() < deadline:  # both ranks are stepping, audited every step
        seen += "running step" in proc.stdout.readline()
    import psutil

    ranks = psutil.Process(proc.pid).children(recursive=True)
    assert len(ranks) >= 2 and seen >= 4, f"{len(ranks)} rank processes, {seen} steps seen before Ctrl-C"
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal sends to the whole foreground group
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("torchrun did not end within 60 s of Ctrl-C")
    _, alive = psutil.wait_procs(ranks, timeout=30)
    assert not alive, f"ranks still running after Ctrl-C: {alive}"
    assert proc.returncode != 0, "torchrun exited 0 after Ctrl-C"


def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from wrapperroute.cli import main

    for args, words in ((["--steps", "0", "x.py"], "--steps takes a positive number"),
                        (["--on-desync", "loud", "x.py"], "--on-desync takes exit, raise or warn"),
                        ([], "no script to run"), (["missing.py"], "no such script: missing.py")):  # fmt: skip
        code = main(["audit", *args])
        assert code == 2, f"audit {args}: exit status {code}, not the usage error's 2"
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, err


def test_single_process_audits_nothing_and_says_so() -> None:
    env = {**ENV, "WORLD_SIZE": "1", "RANK": "0", "MASTER_PORT": str(_port())}
    command = [sys.executable, "-m", "wrapperroute", "audit", str(SCRIPTS / "small.py"), "--case", "nothing"]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "wrapperroute audit: nothing audited" in done.stdout, f"the final line is missing: {done.stdout[-2000:]}"


# --- the comparison itself, on the pool's ranks --------------------------------------------------------------


@pytest.mark.parametrize("extra_on_rank", [None, 1], ids=["same keys", "rank 1 holds one more"])
def test_compare_finds_the_one_differing_gradient(pool: RankPool, extra_on_rank: int | None) -> None:
    """The signatures travel as one tensor when every rank compares the same keys, the rows themselves when
    not: either way the one gradient that differs is found, with its exact difference, and nothing else."""
    import rankside_audit

    for differ_at, expected in ((None, []), ("b", [("ddp[0].b", "gradient", 0.5)])):
        pool.run(rankside_audit.compare_replicas, differ_at, extra_on_rank, expected)


def test_repeated_comparison_costs_one_collective(pool: RankPool) -> None:
    """An audited run compares the same rows step after step: after the first comparison (two collectives:
    agree on the rows, then their signatures), one collective each. Rows that change on one rank are still
    compared, by the rows themselves."""
    import rankside_audit

    # then one each; the last: the counts differ, so the rows themselves travel, pickled
    pool.run(rankside_audit.collectives_per_comparison, 3, [2, 1, 1, 2])


def test_every_step_windows_cover_each_gradient_once_in_eight(pool: RankPool) -> None:
    """Auditing every step, a step's gradient signatures read one eighth of each large gradient: a difference
    is seen by the step whose eighth holds it (and measured on the whole tensor), not by the others; read
    whole, it is seen at once."""
    import rankside_audit

    position = 3 * (1 << 17) // 8 + 5  # in the fourth eighth
    pool.run(rankside_audit.compare_in_windows, position, (3, 8))


def test_a_step_that_raises_leaves_no_comparison_pending(pool: RankPool) -> None:
    import rankside_audit

    pool.run(rankside_audit.step_that_raises, timeout=120)
