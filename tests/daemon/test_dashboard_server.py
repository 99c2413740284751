"""The dashboard's server without a browser: a real keyed daemon, the real poller and waitress
over real HTTP. Only GET of the page, its script and the document; the token on every request;
no key material in what it serves; loopback unless keyed; a daemon that does not answer is
said so, and the poller goes on."""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import pytest
from chaos.daemon.client import DaemonClient
from chaos.daemon.dashboard import Dashboard, DashboardConfig, dashboard_token
from daemon_helpers import Cluster, Node, wait_until

from chaos.errors import ConfigError
from chaos.protocol import StatusReply
from chaos.security import ClusterKey, Security


def _get(port: int, path: str, method: str = "GET") -> tuple[int, bytes, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path)
        r = conn.getresponse()
        return r.status, r.read(), dict(r.getheaders())
    finally:
        conn.close()


@pytest.fixture
def key(tmp_path: Path) -> Path:
    return ClusterKey.generate().write(tmp_path / "cluster.key")


def _keyed(cluster: Cluster, key: Path) -> list[Node]:
    """Two keyed daemons, a founding and b joining it; both see both when returned."""
    sec = Security.from_key_file(key)

    def status(node: Node) -> StatusReply:
        with DaemonClient(node.address, timeout_s=2.0, security=sec) as c:
            return c.status()

    a = cluster.spawn("a", extra=("--cluster-key", str(key)), wait=False)
    wait_until(lambda: status(a).state == "active", "a active")
    b = cluster.spawn("b", join=a, neighbors=("a",), extra=("--cluster-key", str(key)),
                      wait=False)  # fmt: skip
    wait_until(lambda: {n.id for n in status(a).nodes} == {"a", "b"} == {
        n.id for n in status(b).nodes}, "a and b to see each other")  # fmt: skip
    return [a, b]


def test_a_keyed_dashboard_serves_only_with_its_token(cluster: Cluster, key: Path) -> None:
    a, b = _keyed(cluster, key)
    board = Dashboard(DashboardConfig(connect=b.address, port=0, key_file=str(key)))
    try:
        token = dashboard_token(ClusterKey.load(key))
        assert board.token == token and board.url.endswith(f"/?token={token}")
        for path in ("/", "/app.js", "/api/cluster"):
            assert _get(board.port, path)[0] == 401
            assert _get(board.port, f"{path}?token={'0' * 64}")[0] == 401
        status, page, headers = _get(board.port, f"/?token={token}")
        assert status == 200 and f'src="app.js?token={token}"'.encode() in page
        assert "script-src 'self'" in headers["Content-Security-Policy"]
        assert _get(board.port, f"/app.js?token={token}")[0] == 200
        assert _get(board.port, f"/api/cluster?token={token}", "POST")[0] == 405
        assert _get(board.port, f"/other?token={token}")[0] == 404
        status, body, _ = _get(board.port, f"/api/cluster?token={token}")
        doc = json.loads(body)
        # b is not the scheduler: the document is the scheduler's (a), asked through b
        assert status == 200 and doc["ok"] and doc["asked"] == "b" and doc["from_scheduler"]
        assert {n["id"] for n in doc["status"]["nodes"]} == {"a", "b"}
        assert set(doc["positions"]) == {"a", "b"}
        assert all(0.0 <= v <= 1.0 for p in doc["positions"].values() for v in p)
        assert any(e["event"] == "view_installed" for e in doc["timeline"])
        text = body.decode()
        with DaemonClient(a.address, timeout_s=5.0, security=Security.from_key_file(key)) as c:
            nodes = c.status().nodes
        assert any(n.public_key for n in nodes)
        for n in nodes:  # the nodes' public keys are not served either
            assert not n.public_key or n.public_key not in text
        assert key.read_bytes().strip().decode(errors="ignore") not in text
    finally:
        board.close()


def test_an_unkeyed_dashboard_binds_loopback_only() -> None:
    with pytest.raises(ConfigError, match="not loopback"):
        DashboardConfig(connect="tcp://127.0.0.1:9", host="0.0.0.0")
    DashboardConfig(connect="tcp://127.0.0.1:9", host="::1")
    with pytest.raises(ConfigError):
        DashboardConfig(connect="tcp://127.0.0.1:9", port=70000)
    with pytest.raises(ConfigError):
        DashboardConfig(connect="tcp://127.0.0.1:9", interval_s=0.0)


def test_a_daemon_that_does_not_answer_is_said_so(cluster: Cluster) -> None:
    a = cluster.spawn("a")
    board = Dashboard(DashboardConfig(connect=a.address, port=0, interval_s=0.1, timeout_s=0.5))
    try:
        assert board.token is None and board.poller.document()["ok"]
        cluster.kill9(a)
        board.poller.poll_once()
        doc = json.loads(_get(board.port, "/api/cluster")[1])
        assert not doc["ok"] and doc["error"]
    finally:
        board.close()
