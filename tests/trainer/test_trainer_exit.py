"""Stopping a training script the way a user does: a signal to its whole process group.

Ctrl+C in a terminal sends SIGINT to every process of the foreground group, and a service
manager sends SIGTERM to all of them: the script and the embedded daemon its ``Trainer`` started
both get it. The script must still leave gracefully through its own ``request_node_exit()``,
without waiting out the leave request's timeout for a daemon that already went away: the
embedded daemon ignores both signals and leaves when the script asks it to.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

SCRIPT = textwrap.dedent(
    """
    import time, torch
    from chaos.trainer import Trainer, capture_exit_event
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(model, opt, join=None)
    print("ready", flush=True)
    while True:
        model(torch.randn(4, 8)).sum().backward()
        trainer.update()
        trainer.check_state_replication()
        time.sleep(0.02)
        if capture_exit_event():
            trainer.request_node_exit()
            print("events", [e["event"] for e in trainer.events], flush=True)
            break
    """
)


def _ignores(pid: int, sig: signal.Signals) -> bool:
    """Whether process ``pid`` ignores ``sig`` (Linux: the ``SigIgn`` mask of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    raise AssertionError(f"no SigIgn line for {pid}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_whole_process_group_still_leaves_gracefully(
    sig: signal.Signals, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    daemons: list[psutil.Process] = []
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", line
        daemons = psutil.Process(proc.pid).children()
        assert daemons, "the Trainer started no embedded daemon"
        for d in daemons:  # the group's signals are for the script: the daemon ignores them
            assert _ignores(d.pid, signal.SIGINT) and _ignores(d.pid, signal.SIGTERM)
        os.killpg(proc.pid, sig)  # the script and its daemon, as a terminal or a service does
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out[-2000:]
        assert "leave request failed" not in out, out[-2000:]
        events = next(ln for ln in out.splitlines() if ln.startswith("events"))
        assert "'left'" in events, out[-2000:]
        for d in daemons:
            with contextlib.suppress(psutil.NoSuchProcess):
                d.wait(timeout=30)  # exits after its leave (it is its script's child)
            assert not d.is_running() or d.status() == psutil.STATUS_ZOMBIE
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        for d in daemons:
            with contextlib.suppress(psutil.NoSuchProcess):
                d.kill()
        proc.wait(timeout=30)
