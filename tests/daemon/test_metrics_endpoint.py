"""The metrics endpoint: only ``/metrics``, a bearer token on keyed daemons, bounded connections
and threads, idle connections closed, and a clean stop.

The daemons are real ``chaos-daemon`` processes on loopback (the ``cluster`` fixture kills and
reaps them, pass or fail); requests are real HTTP over TCP, and the daemon's threads, descriptors
and connections are read with psutil on its pid.
"""

from __future__ import annotations

import http.client
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from chaos.daemon.client import DaemonClient
from chaos.daemon.config import DaemonConfig
from chaos.daemon.metrics import Metrics, ServerLimits, metrics_token
from daemon_helpers import LOG_LEVEL, Cluster, Node, wait_until

from chaos.errors import ConfigError
from chaos.launch import daemon_cli, daemon_env, free_port, free_tcp_address
from chaos.security import ClusterKey, Security

_HTTP_S = 5.0
_MAX_CONNECTIONS = 8
_IDLE_S = 1
_IDLE_CLIENTS = 200


def _get(port: int, path: str = "/metrics", token: str | None = None) -> tuple[int, str]:
    """One HTTP GET on a fresh connection: the status and the body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=_HTTP_S)
    try:
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        conn.request("GET", path, headers=headers)
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


def _keyed(cluster: Cluster, key: Path, *extra: str) -> tuple[Node, int]:
    """A keyed daemon with metrics on a free port (active when returned)."""
    mport = free_port()
    node = cluster.spawn(
        "n1",
        extra=("--cluster-key", str(key), "--metrics-port", str(mport), *extra),
        wait=False,
    )
    sec = Security.from_key_file(key)

    def active() -> bool:
        with DaemonClient(node.address, timeout_s=2.0, security=sec) as c:
            return c.status().state == "active"

    wait_until(active, "n1 active")
    return node, mport


def _token_from_cli(cluster: Cluster, node: Node, key: Path) -> str:
    res = cluster.cli(node, "metrics-token", "--cluster-key", str(key))
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


@pytest.fixture
def key(tmp_path: Path) -> Path:
    return ClusterKey.generate().write(tmp_path / "cluster.key")


def test_a_keyed_daemon_serves_metrics_only_with_the_token(
    cluster: Cluster, key: Path
) -> None:
    node, mport = _keyed(cluster, key)
    token = _token_from_cli(cluster, node, key)
    assert token == metrics_token(ClusterKey.load(key))  # what the daemon derives
    assert _get(mport)[0] == 401
    assert _get(mport, token="0" * 64)[0] == 401
    assert _get(mport, token=token + "0")[0] == 401
    status, body = _get(mport, token=token)
    assert status == 200
    assert 'chaos_epoch{node="n1"}' in body
    for path in ("/", "/metrics/", "/other"):
        assert _get(mport, path, token=token)[0] == 404, path


def test_the_token_command_writes_a_private_file_and_needs_a_key(
    cluster: Cluster, key: Path, tmp_path: Path
) -> None:
    out = tmp_path / "metrics.token"
    env = daemon_env(tmp_path / "run", LOG_LEVEL)
    argv = daemon_cli("metrics-token", "--cluster-key", str(key), "--out", str(out))
    res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    assert out.read_text().strip() == metrics_token(ClusterKey.load(key))
    assert out.stat().st_mode & 0o077 == 0
    env.pop("CHAOS_CLUSTER_KEY", None)
    res = subprocess.run(daemon_cli("metrics-token"), env=env, capture_output=True, text=True,
                         timeout=60, check=False)  # fmt: skip
    assert res.returncode != 0 and "no cluster key" in res.stderr


def test_an_unkeyed_loopback_daemon_needs_no_token_and_serves_only_metrics(
    cluster: Cluster,
) -> None:
    mport = free_port()
    cluster.spawn("n1", extra=("--metrics-port", str(mport)))
    status, body = _get(mport)
    assert status == 200 and 'chaos_epoch{node="n1"}' in body
    assert _get(mport, "/")[0] == 404


def _daemon_connections(proc: psutil.Process, port: int) -> int:
    conns = proc.net_connections(kind="tcp")
    return sum(1 for c in conns if c.laddr and c.laddr[1] == port and c.status == "ESTABLISHED")


@pytest.fixture
def idle_clients() -> Iterator[list[socket.socket]]:
    socks: list[socket.socket] = []
    try:
        yield socks
    finally:
        for s in socks:
            s.close()


def _closed_by_server(s: socket.socket) -> bool:
    s.settimeout(0.0)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset: closed too
        return True


def test_idle_connections_are_bounded_and_closed(
    cluster: Cluster, key: Path, idle_clients: list[socket.socket]
) -> None:
    node, mport = _keyed(
        cluster, key, "--metrics-max-connections", str(_MAX_CONNECTIONS),
        "--metrics-idle-timeout", str(_IDLE_S), "--metrics-threads", "2",
    )  # fmt: skip
    token = _token_from_cli(cluster, node, key)
    assert _get(mport, token=token)[0] == 200  # the server's threads are all up
    proc = psutil.Process(node.proc.pid)
    threads0, fds0 = proc.num_threads(), proc.num_fds()
    for _ in range(_IDLE_CLIENTS):  # accepted by the kernel, then held open without a request
        idle_clients.append(socket.create_connection(("127.0.0.1", mport), timeout=_HTTP_S))
    seen = {"threads": 0, "fds": 0, "conns": 0}

    def sample() -> bool:
        seen["threads"] = max(seen["threads"], proc.num_threads())
        seen["fds"] = max(seen["fds"], proc.num_fds())
        seen["conns"] = max(seen["conns"], _daemon_connections(proc, mport))
        return seen["conns"] > 0

    wait_until(sample, "the daemon accepts idle connections")
    # the server's idle sweep closes what it accepted, then accepts the next ones: all of them
    # are over their idle timeout long before the deadline, and the bound held all along
    closed: set[int] = set()

    def every_one_closed() -> bool:
        sample()
        closed.update(i for i, s in enumerate(idle_clients) if i in closed or _closed_by_server(s))
        return len(closed) == len(idle_clients)

    wait_until(every_one_closed, "every idle connection closed by the daemon", timeout_s=180.0)
    assert seen["conns"] <= _MAX_CONNECTIONS, seen
    assert seen["threads"] <= threads0 + 2, (threads0, seen)  # no thread per connection
    assert seen["fds"] <= fds0 + _MAX_CONNECTIONS + 2, (fds0, seen)
    assert _get(mport, token=token)[0] == 200  # and it still answers


def _server_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """The metrics server's threads (its loop and its workers) started since ``before``."""
    return [t for t in threading.enumerate() if t not in before
            and t.name.startswith(("chaos-metrics", "waitress-"))]  # fmt: skip


def test_closing_the_metrics_stops_its_threads_and_frees_its_port() -> None:
    before = set(threading.enumerate())
    port = free_port()
    m = Metrics("a", port, token=metrics_token(ClusterKey.generate()))
    idle = socket.create_connection(("127.0.0.1", port), timeout=_HTTP_S)
    try:
        assert _get(port)[0] == 401
        assert _server_threads(before)
        assert m.close(timeout_s=10.0) is True
        assert m.close() is True  # idempotent
        assert _server_threads(before) == []
        wait_until(lambda: _closed_by_server(idle), "the open connection closed")
    finally:
        idle.close()
    with socket.create_server(("127.0.0.1", port)):  # the listening socket is gone
        pass


def test_a_port_in_use_fails_without_leaving_threads() -> None:
    before = set(threading.enumerate())
    with socket.create_server(("127.0.0.1", 0)) as taken:
        with pytest.raises(OSError):
            Metrics("a", taken.getsockname()[1])
    assert _server_threads(before) == []


def test_a_half_sent_request_is_closed_after_the_idle_timeout() -> None:
    port = free_port()
    m = Metrics("a", port, limits=ServerLimits(max_connections=4, idle_timeout_s=1, threads=1))
    half = socket.create_connection(("127.0.0.1", port), timeout=_HTTP_S)
    try:
        half.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        wait_until(lambda: _closed_by_server(half), "the half-sent request closed")
        assert _get(port)[0] == 200
    finally:
        half.close()
        m.close()


def test_a_daemon_that_stops_stops_its_metrics(tmp_path: Path) -> None:
    from chaos.daemon.node import Daemon

    before = set(threading.enumerate())
    port = free_port()
    cfg = DaemonConfig(node_id="a", listen=free_tcp_address(), run_dir=str(tmp_path / "run"),
                       metrics_port=port)  # fmt: skip
    daemon = Daemon(cfg)
    real = daemon._step

    def step_then_stop() -> None:
        real()
        daemon.finish(0)

    daemon._step = step_then_stop
    assert _get(port)[0] == 200
    assert daemon.run() == 0
    assert _server_threads(before) == []
    with socket.create_server(("127.0.0.1", port)):
        pass


@pytest.mark.parametrize(
    "bad",
    [
        {"metrics_max_connections": 0},
        {"metrics_max_connections": 5000},
        {"metrics_max_connections": True},
        {"metrics_threads": 0},
        {"metrics_threads": 2.0},
        {"metrics_idle_timeout_s": 0},
        {"metrics_idle_timeout_s": 0.5},
        {"metrics_idle_timeout_s": float("inf")},
    ],
)
def test_the_metrics_bounds_are_checked(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match=next(iter(bad))):
        DaemonConfig(node_id="a", listen="tcp://127.0.0.1:5000", **bad)  # type: ignore[arg-type]
    ok = DaemonConfig(node_id="a", listen="tcp://127.0.0.1:5000", metrics_idle_timeout_s=3.0)
    assert (ok.metrics_max_connections, ok.metrics_threads) == (32, 2)
