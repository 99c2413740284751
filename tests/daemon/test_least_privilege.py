"""Who may do what, against live daemons: faults only with ``--enable-fault-injection``;
``leave``, ``link`` and ``fault`` only on the local IPC socket (or from a key holder where the
daemon allows remote operators); a handover only from the scheduler a member follows; no
``connect_command`` re-points a peer.
And the keys themselves: ``keygen`` writes a private file once, and a daemon refuses to listen
beyond loopback without a key unless told ``--insecure``.

Every process is killed and reaped when its test ends.
"""

from __future__ import annotations

import contextlib
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from chaos.daemon.client import DaemonClient, RequestRefused
from chaos.daemon.config import ipc_endpoint_for
from daemon_helpers import Cluster, Node, wait_until

from chaos.launch import (
    daemon_cli,
    daemon_command,
    daemon_env,
    free_port,
    kill_and_reap,
    spawn_daemon,
)
from chaos.protocol import PROTOCOL_VERSION, VoteReply, decode

_REPLY_S = 10.0


def _frame(**fields: Any) -> bytes:
    return msgspec.msgpack.encode({"v": PROTOCOL_VERSION, **fields})


@pytest.fixture
def raw() -> Iterator[Any]:
    """Sends one raw frame to an endpoint on a fresh DEALER and returns the decoded answer."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socks: list[zmq.Socket[bytes]] = []

    def ask(endpoint: str, frame: bytes) -> Any:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        socks.append(s)
        s.connect(endpoint)
        s.send(frame)
        if not s.poll(int(_REPLY_S * 1000), zmq.POLLIN):
            pytest.fail(f"no answer from {endpoint}")
        return decode(s.recv_multipart()[-1], 64 << 20)

    yield ask
    for s in socks:
        s.close(linger=0)
    ctx.term()


def _events(node: Node, name: str) -> list[dict[str, Any]]:
    return [e for e in node.events() if e["event"] == name]


def _refused(reason: str, call: Any) -> None:
    with pytest.raises(RequestRefused) as info:
        call()
    assert info.value.reason == reason, info.value


# -- faults --------------------------------------------------------------------------------


def test_fault_is_refused_without_enable_fault_injection(cluster: Cluster) -> None:
    n1 = cluster.spawn("n1", fault_injection=False)
    with n1.local_client() as c:
        _refused("forbidden", lambda: c.fault("cut_link", ["n2"]))
    res = cluster.cli(n1, "fault", "clear")
    assert res.returncode != 0 and "forbidden" in res.stderr, res.stderr
    assert _events(n1, "refused_command")
    assert n1.status().node_id == "n1"


def test_fault_works_with_enable_fault_injection(cluster: Cluster) -> None:
    n1 = cluster.spawn("n1", fault_injection=True)
    with n1.local_client() as c:
        assert c.fault("drop_to", ["n9"]).active == ["drop_to:n9"]
        assert c.fault("clear", []).active == []


def test_fault_presets_need_enable_fault_injection(tmp_path: Path) -> None:
    argv = daemon_command(
        "a", f"tcp://127.0.0.1:{free_port()}", extra_args=["--fault", "drop_to:b"]
    )
    res = subprocess.run(
        argv,
        env=daemon_env(tmp_path / "a"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert res.returncode != 0 and "enable-fault-injection" in res.stderr, res.stderr


# -- the TCP endpoint without a key --------------------------------------------------------


def test_unauthenticated_tcp_may_read_status_but_not_change_anything(cluster: Cluster) -> None:
    n1 = cluster.spawn("n1", fault_injection=True)
    n2 = cluster.spawn("n2", join=n1, fault_injection=True)
    wait_until(lambda: {n.id for n in n1.status().nodes} == {"n1", "n2"}, "two members")
    with DaemonClient(n2.address, timeout_s=10.0) as tcp:
        assert tcp.status().node_id == "n2"
        _refused("forbidden", lambda: tcp.leave())
        _refused("forbidden", lambda: tcp.link("n1", add=False))
        _refused("forbidden", lambda: tcp.fault("partition", ["n2"]))
    res = cluster.cli(n2, "leave", "--connect", n2.address)
    assert res.returncode != 0 and "forbidden" in res.stderr, res.stderr
    assert n2.alive() and {n.id for n in n1.status().nodes} == {"n1", "n2"}
    assert n2.status().paused is False
    # the local socket may: n2 leaves and exits cleanly
    with n2.local_client(timeout_s=20.0) as ipc:
        assert ipc.leave(timeout_s=20.0).ok
    assert n2.proc.wait(timeout=30) == 0


# -- elections -----------------------------------------------------------------------------


def test_a_vote_transfer_or_handover_from_a_non_scheduler_is_ignored(
    cluster: Cluster, raw: Any
) -> None:
    nodes = cluster.start(3)
    n1, n2 = nodes[0], nodes[1]
    wait_until(lambda: all(n.status().scheduler == "n1" for n in nodes), "n1 schedules")
    st = n2.status()
    # n3 (a member, not the scheduler) asks n2 for a transfer vote in a much later term
    vote = _frame(type="request_vote", sender="n3", epoch=st.epoch, term=st.term + 50,
                  transfer=True)  # fmt: skip
    answer = raw(n2.address, vote)
    assert isinstance(answer, VoteReply) and not answer.granted, answer
    wait_until(lambda: _events(n2, "transfer_ignored"), "the transfer ignored")
    # and a handover order from it too
    raw_sock_answerless = _frame(type="timeout_now", sender="n3", epoch=st.epoch, term=st.term)
    _send_only(n2.address, raw_sock_answerless)
    wait_until(lambda: _events(n2, "handover_ignored"), "the handover ignored")
    assert not _events(n2, "election_started")
    after = n2.status()
    assert after.scheduler == "n1" and after.term == st.term and not after.paused
    assert n1.status().role == "scheduler"


def _send_only(endpoint: str, frame: bytes) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    try:
        s.setsockopt(zmq.LINGER, 1000)
        s.connect(endpoint)
        s.send(frame)
    finally:
        s.close(linger=1000)  # flushed before the context ends
        ctx.term()


# -- connect commands ----------------------------------------------------------------------


def test_a_connect_command_cannot_re_point_a_peer(cluster: Cluster) -> None:
    n1 = cluster.spawn("n1")
    n2 = cluster.spawn("n2", join=n1)
    wait_until(lambda: {n.id for n in n2.status().nodes} == {"n1", "n2"}, "two members")
    st = n2.status()
    elsewhere = f"tcp://127.0.0.1:{free_port()}"
    frame = _frame(type="connect_command", sender="n1", epoch=st.epoch, term=st.term, peer="n1",
                   address=elsewhere, measure_bandwidth=False, op_id="evil")  # fmt: skip
    _send_only(n2.address, frame)
    wait_until(lambda: _events(n2, "connect_refused"), "the re-pointing refused")
    ev = _events(n2, "connect_refused")[-1]
    assert ev["peer"] == "n1" and ev["address"] == elsewhere and ev["current"] == n1.address
    # n2 still reaches n1: heartbeats keep it a member that follows n1
    wait_until(lambda: n2.status().scheduler == "n1" and not n2.status().paused, "n2 follows n1")
    assert {n.id for n in n1.status().nodes} == {"n1", "n2"}
    assert not _events(n1, "node_failed")


# -- keys and the secure default -----------------------------------------------------------


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        daemon_cli(*args), capture_output=True, text=True, timeout=60, check=False, env=env
    )


def test_keygen_writes_a_private_key_once(tmp_path: Path) -> None:
    key = tmp_path / "cluster.key"
    res = _cli("keygen", str(key))
    assert res.returncode == 0, res.stderr
    assert "fingerprint" in res.stdout
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    first = key.read_bytes()
    again = _cli("keygen", str(key))
    assert again.returncode != 0 and "exists already" in again.stderr, again.stderr
    assert key.read_bytes() == first


def test_a_non_loopback_listen_needs_a_key_or_insecure(tmp_path: Path) -> None:
    listen = f"tcp://0.0.0.0:{free_port('0.0.0.0')}"
    refused = subprocess.run(
        daemon_command("a", listen), env=daemon_env(tmp_path / "a"), capture_output=True,
        text=True, timeout=60, check=False,
    )  # fmt: skip
    assert refused.returncode != 0 and "without a cluster key" in refused.stderr, refused.stderr
    run_dir = tmp_path / "b"
    proc = spawn_daemon(daemon_command("b", listen, extra_args=["--insecure"]), run_dir)
    try:
        ipc = ipc_endpoint_for(str(run_dir))

        def answers() -> bool:
            with DaemonClient(ipc, timeout_s=2.0) as c:
                return c.status().node_id == "b"

        wait_until(answers, "the insecure daemon to answer")
        log = (run_dir / "daemon.log").read_text()
        assert "WARNING" in log and "without a cluster key" in log, log
    finally:
        kill_and_reap([proc])


@contextlib.contextmanager
def _keyed_daemon(tmp_path: Path, **options: Any) -> Iterator[tuple[Any, Path, str]]:
    """A keyed daemon ``a`` on loopback, answering; yields its process, key and TCP endpoint
    (killed and reaped at the end)."""
    key = tmp_path / "cluster.key"
    assert _cli("keygen", str(key)).returncode == 0
    run_dir = tmp_path / "a"
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    proc = spawn_daemon(daemon_command("a", endpoint, cluster_key=key, **options), run_dir,
                        log_level="WARNING")  # fmt: skip
    try:
        env = daemon_env(run_dir)
        wait_until(lambda: _cli("status", env=env).returncode == 0, "the keyed daemon")
        yield proc, key, endpoint
    finally:
        kill_and_reap([proc])


def test_client_commands_take_the_key_from_the_environment(tmp_path: Path) -> None:
    with _keyed_daemon(tmp_path, extra_args=("--allow-remote-operator",)) as (proc, key, ep):
        env = daemon_env(tmp_path / "a")
        keyed = _cli("status", "--connect", ep, "--json",
                     env={**env, "CHAOS_CLUSTER_KEY": str(key)})  # fmt: skip
        assert keyed.returncode == 0, keyed.stderr
        # over TCP a key holder may leave, as this daemon allows remote operators
        leave = _cli("leave", "--connect", ep, "--cluster-key", str(key))
        assert leave.returncode == 0, leave.stderr
        assert proc.wait(timeout=30) == 0


def test_a_key_holder_may_not_send_operator_commands_unless_the_daemon_allows_it(
    tmp_path: Path,
) -> None:
    """A cluster key is not a crown: over TCP, leave, link and fault are refused from any key
    holder unless the daemon runs with --allow-remote-operator; status still answers."""
    with _keyed_daemon(tmp_path, enable_fault_injection=True) as (proc, key, ep):
        tcp = ("--connect", ep, "--cluster-key", str(key))
        for args in (("leave",), ("link", "remove", "b"), ("fault", "clear")):
            res = _cli(*args, *tcp)
            assert res.returncode != 0, res.stdout
            assert "forbidden" in res.stderr and "--allow-remote-operator" in res.stderr, res.stderr
        assert _cli("status", *tcp).returncode == 0
        assert proc.poll() is None
        assert _cli("leave", env=daemon_env(tmp_path / "a")).returncode == 0  # on the IPC socket
        assert proc.wait(timeout=30) == 0


def test_remote_operators_need_a_cluster_key(tmp_path: Path) -> None:
    argv = daemon_command("a", f"tcp://127.0.0.1:{free_port()}",
                          extra_args=["--allow-remote-operator"])  # fmt: skip
    res = subprocess.run(argv, env=daemon_env(tmp_path / "a"), capture_output=True, text=True,
                         timeout=60, check=False)  # fmt: skip
    assert res.returncode != 0 and "needs a cluster key" in res.stderr, res.stderr
