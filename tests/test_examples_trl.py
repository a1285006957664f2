"""The custom-loop example runs as users run it (it spawns its own 2 gloo ranks) and prints exact gradients.

examples/hf_trainer_routed.py and examples/trl_fork_patch.py take 35 s to 1 min on 2 CPU cores, mostly imports;
what they show is measured in the rank pool by tests/test_routed.py and tests/test_trl.py on the same trainers.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _run(name: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr  # the rank workers print to stderr (see wrapperroute/ranks.py)


def test_custom_loop() -> None:
    out = _run("custom_loop.py")
    assert "{'routed': [0, 0, 0], 'unrouted': [6, 6, 6]}" in out, f"the differing parameters per step: {out[-3000:]}"
