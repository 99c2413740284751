"""The cluster of the Trainer integration tests: real worker processes on loopback.

Each member is a worker script (``worker.py``, or ``semantics_worker.py`` for the training
semantics) run in its own session, with its embedded daemon in its process group. A worker
appends one JSON line per step with a digest of its model and optimizer state, so members are
bitwise equal when their digests at the same step are equal. :class:`Cluster` starts members,
waits for conditions with a generous deadline (never asserting timing) and, on close, kills and
reaps every process group it started.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from chaos.daemon.client import DaemonClient
from chaos.daemon.config import ipc_endpoint_for

from chaos.errors import ChaosTimeout
from chaos.launch import ProcessExited, free_port, kill_and_reap, spawn_worker, wait_until
from chaos.protocol.messages import StatusReply
from chaos.security import ClusterKey

WORKER = Path(__file__).with_name("worker.py")
SEMANTICS_WORKER = Path(__file__).with_name("semantics_worker.py")
DEADLINE_S = 120.0
DAEMON_ARGS = ("--heartbeat-interval", "0.2", "--failure-timeout", "1.0")


class Member:
    """One training process (and, in its process group, its embedded daemon)."""

    def __init__(self, node_id: str, out: Path, proc: subprocess.Popen[bytes], port: int):
        self.id = node_id
        self.out = out
        self.proc = proc
        self.address = f"tcp://127.0.0.1:{port}"

    def records(self) -> list[dict[str, Any]]:
        if not self.out.exists():
            return []
        lines = self.out.read_text().splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]

    def digests(self) -> dict[int, str]:
        return {r["step"]: r["digest"] for r in self.records() if "digest" in r}

    def last(self) -> dict[str, Any]:
        steps = [r for r in self.records() if "digest" in r]
        return steps[-1] if steps else {}

    def phases(self) -> list[str]:
        """The lifecycle phases its trainer moved to, in order (its ``phase`` events)."""
        return [r["phase"] for r in self.records() if r.get("event") == "phase"]

    def leave(self) -> None:
        self.out.with_suffix(".leave").touch()

    def log(self) -> str:
        path = self.out.with_suffix(".log")
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""


class Cluster:
    """Starts workers in their own sessions; kills every process group on close.

    Args:
        tmp: The test's directory (records, logs, run directories).
        worker: The worker script every member runs.
    """

    daemon_args: tuple[str, ...] = DAEMON_ARGS

    def __init__(self, tmp: Path, worker: Path = WORKER) -> None:
        self.tmp = tmp
        self.worker = worker
        self.members: dict[str, Member] = {}

    def node_args(self, node_id: str) -> list[str]:
        """Worker arguments every member gets (subclasses add theirs)."""
        return []

    def start(self, node_id: str, join: Member | None = None, *extra: str) -> Member:
        port = free_port()
        out = self.tmp / f"{node_id}.jsonl"
        argv = [sys.executable, str(self.worker), "--id", node_id, "--out", str(out)]
        argv += ["--listen", f"tcp://127.0.0.1:{port}", *self.node_args(node_id), *extra]
        for arg in self.daemon_args:
            argv.append(f"--daemon-arg={arg}")
        if join is not None:
            argv += ["--join", join.address]
        proc = spawn_worker(argv, log_path=out.with_suffix(".log"), append=False)
        member = Member(node_id, out, proc, port)
        self.members[node_id] = member
        return member

    def wait(self, pred: Callable[[], Any], what: str) -> Any:
        procs = {m.id: m.proc for m in self.members.values()}
        try:  # exit code 70: a member that was made to fail
            return wait_until(pred, DEADLINE_S, what, poll_s=0.1, watch=procs, ok=(0, 70))
        except ProcessExited as exc:
            pytest.fail(f"{exc}:\n{self.members[exc.name].log()}")
        except ChaosTimeout as exc:
            logs = "\n".join(f"--- {m.id}\n{m.log()}" for m in self.members.values())
            pytest.fail(f"{exc}\n{logs}")

    def close(self) -> None:
        kill_and_reap([m.proc for m in self.members.values()], group=True)


class KeyedCluster(Cluster):
    """Workers that all hold one cluster key (``self.key``, a file in the test's directory),
    each with its embedded daemon's run directory, so that a test can ask its status."""

    def __init__(self, tmp: Path, worker: Path = WORKER) -> None:
        super().__init__(tmp, worker)
        self.key = ClusterKey.generate().write(tmp / "cluster.key")

    def node_args(self, node_id: str) -> list[str]:
        return ["--cluster-key", str(self.key), "--daemon-dir", str(self.tmp / f"{node_id}.daemon")]

    def status(self, node_id: str) -> StatusReply:
        with DaemonClient(ipc_endpoint_for(str(self.tmp / f"{node_id}.daemon"))) as c:
            return c.status()


def in_order(seen: list[str], wanted: list[str]) -> bool:
    """Whether ``wanted`` occurs in ``seen`` in this order (other items between allowed)."""
    it = iter(seen)
    return all(w in it for w in wanted)


def world(member: Member, size: int, after_step: int = 0) -> bool:
    """Whether ``member``'s last step ran with ``size`` members, past ``after_step``."""
    last = member.last()
    return bool(last) and last["world"] == size and last["step"] > after_step


def assert_equal_from(members: list[Member], first_step: int) -> int:
    """Every step from ``first_step`` that all members recorded has one digest; returns the
    number of steps compared."""
    digests = [m.digests() for m in members]
    common = set.intersection(*(set(d) for d in digests))
    common = {s for s in common if s >= first_step}
    assert common, "the members recorded no common step"
    for step in sorted(common):
        seen = {d[step] for d in digests}
        assert len(seen) == 1, f"members differ at step {step}"
    return len(common)
