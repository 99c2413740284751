"""The examples run as the README says: one command starts a real multi-process cluster.

Each test runs an example's launcher as a real subprocess with small settings. The launcher
starts its workers (each with an embedded daemon) on loopback, walks them through a join in the
middle of training and a graceful leave, and must exit 0 having printed those membership events.
Every process is reaped, also when the test fails: the launcher on its own (SIGTERM makes it
stop and reap its workers), and anything it left behind by the test.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from chaos.launch import stop_tree

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TIMEOUT_S = 300.0
_STEP = re.compile(r"^\[(n\d+)\] step\s+(\d+) \| world (\d+) \|.* \| (test_acc|val_loss) (\S+)$")


def _run(argv: list[str], tmp_path: Path) -> tuple[int, str]:
    """Runs a launcher; on a timeout or an error, stops it and reaps every descendant."""
    out_path = tmp_path / "out.txt"
    with out_path.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, *argv], stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path
        )
    try:
        try:
            code = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
        return (code if code is not None else -1), out_path.read_text(errors="replace")
    finally:  # SIGTERM: the launcher asks its workers to leave and reaps them
        stop_tree(proc, signal.SIGTERM, grace_s=60.0)


def _check_scenario(code: int, out: str, metric: str) -> None:
    assert code == 0, out[-6000:]
    assert "** membership" in out and "(joined: n3)" in out, out[-6000:]
    assert "(left: n2)" in out, out[-6000:]
    assert "[n2] ** left the cluster" in out, out[-6000:]
    assert "[n3] ** state pulled" in out, out[-6000:]
    assert "all 3 workers exited cleanly" in out, out[-6000:]
    # The members hold one model: at a step they all reported, the metric on the shared
    # evaluation data is the same on every one of them.
    seen: dict[int, dict[str, str]] = defaultdict(dict)
    for line in out.splitlines():
        m = _STEP.match(line)
        if m and m[4] == metric:
            seen[int(m[2])][m[1]] = m[5]
    shared = {step: v for step, v in seen.items() if len(v) >= 2}
    assert shared, "no step was reported by two members"
    for step, values in shared.items():
        assert len(set(values.values())) == 1, f"members differ at step {step}: {values}"


def test_digits_classifier_launcher(tmp_path: Path) -> None:
    argv = [str(EXAMPLES / "digits_classifier.py"), "--nodes", "3", "--phase-steps", "20"]
    argv += ["--log-every", "5"]
    code, out = _run(argv, tmp_path)
    _check_scenario(code, out, "test_acc")


def test_lora_gpt_launcher(tmp_path: Path) -> None:
    argv = [str(EXAMPLES / "lora_gpt.py"), "--nodes", "3", "--phase-steps", "20"]
    argv += ["--log-every", "5", "--pretrain-steps", "20"]
    code, out = _run(argv, tmp_path)
    _check_scenario(code, out, "val_loss")
    assert "[n1] sample:" in out


def test_nanogpt_style_launcher(tmp_path: Path) -> None:
    """The nanoGPT-style loop: tied weights, AdamW groups, LambdaLR and GradScaler in
    extra_state, clipping in before_step, accumulation, and a global batch split by speed."""
    argv = [str(EXAMPLES / "nanogpt_style.py"), "--nodes", "3", "--phase-steps", "20"]
    argv += ["--log-every", "5", "--global-batch", "24", "--accum", "2"]
    code, out = _run(argv, tmp_path)
    _check_scenario(code, out, "val_loss")
