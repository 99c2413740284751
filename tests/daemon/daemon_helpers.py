"""Helpers for multi-process daemon tests: real ``chaos-daemon`` processes on loopback.

Every process a test starts is killed (SIGKILL) and reaped when the test ends, pass or fail.
Tests poll ``status`` with generous deadlines and never assert timing.
"""

from __future__ import annotations

import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from chaos.daemon.client import DaemonClient
from chaos.daemon.config import ipc_endpoint_for
from chaos.daemon.events import read_events

from chaos import launch
from chaos.errors import ChaosError, ChaosTimeout
from chaos.launch import (
    daemon_cli,
    daemon_command,
    daemon_env,
    free_port,
    kill_and_reap,
    spawn_daemon,
)
from chaos.protocol import StatusReply

# Fast but safe settings for tests (CLI flags and a TOML file, as a user would).
HB_S = 0.1
FT_S = 0.5
TEST_TOML = """
link_probe_interval_s = 0.1
link_failure_timeout_s = 0.8
election_timeout_min_s = 0.5
election_timeout_max_s = 1.0
bandwidth_probe_bytes = 262144
bandwidth_probe_chunk_bytes = 65536
resource_interval_s = 1.0
"""
DEADLINE_S = 30.0
LOG_LEVEL = "WARNING"


def in_background(
    request: Callable[[DaemonClient], Any], ipc: str, timeout_s: float = 60.0
) -> tuple[threading.Thread, dict[str, Any]]:
    """Runs ``request`` with a client of the daemon at ``ipc`` on a daemon thread (started).

    Returns:
        The thread, and a dict that gets ``"result"`` (what ``request`` returned) or
        ``"error"`` (what it raised) when the request ends.
    """
    answer: dict[str, Any] = {}

    def run() -> None:
        try:
            with DaemonClient(ipc, timeout_s=timeout_s) as client:
                answer["result"] = request(client)
        except Exception as exc:  # noqa: BLE001 - handed to the test's assertions
            answer["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, answer


def wait_until(pred: Callable[[], Any], what: str, timeout_s: float = DEADLINE_S) -> Any:
    """Polls ``pred`` until it returns a truthy value; fails the test at the deadline."""
    try:
        return launch.wait_until(pred, timeout_s, what, tolerate=(ChaosError, OSError))
    except ChaosTimeout as exc:
        pytest.fail(str(exc))


class Node:
    """One daemon process."""

    def __init__(self, node_id: str, port: int, proc: subprocess.Popen[bytes], run_dir: Path):
        self.id = node_id
        self.port = port
        self.address = f"tcp://127.0.0.1:{port}"
        self.proc = proc
        self.run_dir = run_dir

    @property
    def ipc(self) -> str:
        return ipc_endpoint_for(str(self.run_dir))

    @property
    def events_path(self) -> Path:
        return self.run_dir / f"events-{self.id}.jsonl"

    def events(self) -> list[dict[str, Any]]:
        return read_events(self.events_path) if self.events_path.exists() else []

    def client(self, timeout_s: float = 5.0) -> DaemonClient:
        """A client over TCP (read-only without a cluster key: ``status``, trainer messages)."""
        return DaemonClient(self.address, timeout_s=timeout_s)

    def local_client(self, timeout_s: float = 5.0) -> DaemonClient:
        """A client over the local IPC socket (``leave``, ``link`` and ``fault`` need it)."""
        return DaemonClient(self.ipc, timeout_s=timeout_s)

    def status(self, timeout_s: float = 2.0) -> StatusReply:
        with self.client(timeout_s) as c:
            return c.status()

    def alive(self) -> bool:
        return self.proc.poll() is None


class Cluster:
    """Starts daemons and guarantees they are all killed and reaped."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.nodes: dict[str, Node] = {}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.config = tmp / "test.toml"
        self.config.write_text(TEST_TOML)

    def spawn(
        self,
        node_id: str,
        join: Node | None = None,
        neighbors: tuple[str, ...] = (),
        extra: tuple[str, ...] = (),
        wait: bool = True,
        fault_injection: bool = True,
        port: int | None = None,
    ) -> Node:
        port = port if port is not None else free_port()
        run_dir = self.tmp / node_id
        argv = daemon_command(
            node_id,
            f"tcp://127.0.0.1:{port}",
            join=join.address if join is not None else None,
            neighbors=neighbors,
            config=self.config,
            heartbeat_interval_s=HB_S,
            failure_timeout_s=FT_S,
            enable_fault_injection=fault_injection,  # tests inject faults by name
            extra_args=extra,
        )
        proc = spawn_daemon(argv, run_dir, log_path=run_dir / "stderr.log", log_level=LOG_LEVEL)
        self.procs.append(proc)
        node = Node(node_id, port, proc, run_dir)
        self.nodes[node_id] = node
        if wait:
            wait_until(lambda: node.status().state == "active", f"{node_id} active")
        return node

    def start(self, n: int, prefix: str = "n") -> list[Node]:
        """Starts ``n`` daemons: the first founds the cluster, each next joins through the
        previous one with it as neighbour (a path, plus a link back to the first)."""
        first = self.spawn(f"{prefix}1")
        nodes = [first]
        for i in range(2, n + 1):
            prev = nodes[-1]
            nbrs = (prev.id,) if i < 3 else (prev.id, first.id)
            nodes.append(self.spawn(f"{prefix}{i}", join=prev, neighbors=nbrs))
        ids = {x.id for x in nodes}
        wait_until(lambda: all(self.members(x) == ids for x in nodes), "everyone sees everyone")
        return nodes

    def members(self, node: Node) -> set[str]:
        return {n.id for n in node.status().nodes}

    def cli(
        self, node: Node, *args: str, timeout_s: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        """Runs a ``chaos-daemon`` client command against ``node``'s local IPC endpoint."""
        return subprocess.run(
            daemon_cli(*args),
            env=daemon_env(node.run_dir, LOG_LEVEL),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    def kill9(self, node: Node) -> None:
        node.proc.send_signal(signal.SIGKILL)
        node.proc.wait(timeout=10)

    def close(self) -> None:
        kill_and_reap(self.procs, timeout_s=10.0)


def scheduler_of(node: Node) -> str | None:
    """The scheduler ``node`` follows (``None`` if it knows none)."""
    return node.status().scheduler
