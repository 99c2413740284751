"""A stalled step raises what the docs promise: ``TrainingStalled`` (a ``ChaosTimeout``).

Two real training processes, each with its embedded daemon, over loopback. One member is
killed (``kill -9`` of its process group) while the other's daemon is paused with SIGSTOP, so
the survivor's allreduce fails and the new policy it then waits for never comes. The survivor
records which exception ``update()`` raised. Every process group is killed and reaped at the
end, the paused daemon resumed first.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chaos.launch import free_port, kill_and_reap, signal_group, spawn_worker, wait_until

WORKER = Path(__file__).with_name("stall_worker.py")
DEADLINE_S = 120.0
DAEMON_ARGS = ("--heartbeat-interval", "0.2", "--failure-timeout", "1.0")


def _records(out: Path) -> list[dict[str, Any]]:
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.endswith("}")]


def _log(out: Path) -> str:
    path = out.with_suffix(".log")
    return path.read_text(errors="replace")[-3000:] if path.exists() else ""


class Pair:
    """The two workers; on close, resumes any paused daemon and reaps every process group."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.paused: list[int] = []
        self.killed: set[str] = set()

    def start(self, node_id: str, join: str | None, *extra: str) -> tuple[Path, str]:
        port = free_port()
        out = self.tmp / f"{node_id}.jsonl"
        address = f"tcp://127.0.0.1:{port}"
        argv = [sys.executable, str(WORKER), "--id", node_id, "--out", str(out), *extra]
        argv += ["--listen", address] + [f"--daemon-arg={a}" for a in DAEMON_ARGS]
        if join is not None:
            argv += ["--join", join]
        self.procs[node_id] = spawn_worker(argv, log_path=out.with_suffix(".log"), append=False)
        return out, address

    def wait(self, pred: Any, what: str) -> Any:
        watch = {n: p for n, p in self.procs.items() if n not in self.killed}
        return wait_until(pred, DEADLINE_S, what, poll_s=0.1, watch=watch, ok=(0, 3))

    def close(self) -> None:
        for pid in self.paused:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        kill_and_reap(self.procs.values(), group=True)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    p = Pair(tmp_path)
    try:
        yield p
    finally:
        p.close()


def _world2(out: Path) -> bool:
    steps = [r for r in _records(out) if "world" in r]
    return bool(steps) and steps[-1]["world"] == 2


def test_a_step_whose_policy_never_comes_raises_training_stalled(pair: Pair) -> None:
    a_out, a_address = pair.start("a", None)
    pair.wait(lambda: any("step" in r for r in _records(a_out)), "a to train")
    b_out, _ = pair.start("b", a_address)
    pair.wait(lambda: _world2(a_out) and _world2(b_out), "b to join a")
    daemon_pid = next(r["daemon_pid"] for r in _records(a_out) if "daemon_pid" in r)
    assert isinstance(daemon_pid, int)

    os.kill(daemon_pid, signal.SIGSTOP)  # a's policy will never come
    pair.paused.append(daemon_pid)
    pair.killed.add("b")
    signal_group(pair.procs["b"], signal.SIGKILL)  # a's allreduce fails

    error = pair.wait(
        lambda: next((r for r in _records(a_out) if "error" in r), None), "a's update() to raise"
    )
    assert error["error"] == "TrainingStalled", f"{error}\n{_log(a_out)}"
    assert "ChaosTimeout" in error["bases"] and "TimeoutError" in error["bases"]
    assert pair.procs["a"].wait(timeout=DEADLINE_S) == 3


def test_training_stalled_is_a_chaos_timeout_and_exported() -> None:
    from chaos.errors import ChaosTimeout
    from chaos.trainer import TrainingStalled

    assert issubclass(TrainingStalled, ChaosTimeout)
    assert issubclass(TrainingStalled, TimeoutError)


def test_update_after_training_stalled_waits_again_and_resumes_when_the_cluster_heals(
    pair: Pair,
) -> None:
    """A script that catches TrainingStalled and calls update() again gets the same wait (not
    an error about the step it already ran), and trains on once a new policy comes. Three
    members, so that the two left after a kill still hold a majority."""
    a_out, a_address = pair.start("a", None, "--retries", "40", "--policy-timeout", "3")
    pair.wait(lambda: any("step" in r for r in _records(a_out)), "a to train")
    b_out, _ = pair.start("b", a_address, "--retries", "40", "--policy-timeout", "3")
    pair.wait(lambda: _world2(a_out) and _world2(b_out), "b to join a")
    c_out, _ = pair.start("c", a_address)
    pair.wait(lambda: any(r.get("world") == 3 for r in _records(a_out)), "c to join")
    daemon_pid = next(r["daemon_pid"] for r in _records(a_out) if "daemon_pid" in r)
    os.kill(daemon_pid, signal.SIGSTOP)  # no policy while it is stopped
    pair.paused.append(daemon_pid)
    pair.killed.add("c")
    signal_group(pair.procs["c"], signal.SIGKILL)

    def errors() -> list[dict[str, Any]]:
        return [r for r in _records(a_out) if "error" in r]

    pair.wait(lambda: len(errors()) >= 2, "a's update() to give up twice")
    assert [e["error"] for e in errors()[:2]] == ["TrainingStalled"] * 2, errors()
    os.kill(daemon_pid, signal.SIGCONT)  # the daemon scales c in: a new policy comes
    pair.paused.remove(daemon_pid)
    stalled_at = len(_records(a_out))
    pair.wait(lambda: any(r.get("world") == 2 for r in _records(a_out)[stalled_at:]),
              "a to train on with b")  # fmt: skip
    assert all(e["error"] == "TrainingStalled" for e in errors()), errors()
