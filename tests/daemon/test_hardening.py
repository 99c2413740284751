"""Inputs that once crashed a live daemon, and the guards around its loop: it survives each one
and keeps answering ``status``.

Every daemon here is a real ``chaos-daemon`` process on loopback, killed and reaped when the
test ends (the ``cluster`` fixture). Tests wait for conditions, never for time.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import socket
import stat
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest
import zmq
from chaos.daemon.config import DaemonConfig, ensure_private_run_dir
from chaos.daemon.dispatch import Dispatcher, TokenBucket
from chaos.daemon.events import EventLog, read_events
from chaos.daemon.timers import Timers
from daemon_helpers import Cluster, Node, wait_until

from chaos.errors import ConfigError
from chaos.launch import free_tcp_address
from chaos.protocol import PROTOCOL_VERSION, Ping, Refusal, decode
from chaos.security import ClusterKey
from tests.daemon.recorder import recording_context

_REPLY_S = 10.0


def _frame(**fields: Any) -> bytes:
    return msgspec.msgpack.encode({"v": PROTOCOL_VERSION, **fields})


def _answer(sock: zmq.Socket[bytes], frame: bytes) -> Any:
    sock.send(frame)
    if not sock.poll(int(_REPLY_S * 1000), zmq.POLLIN):
        pytest.fail("no answer from the daemon")
    return decode(sock.recv_multipart()[-1], 64 << 20)


def _answers(sock: zmq.Socket[bytes], want: int) -> list[Any]:
    """Receives ``want`` answers (fails the test at the deadline)."""
    got: list[Any] = []

    def more() -> bool:
        while sock.poll(0, zmq.POLLIN):
            got.append(decode(sock.recv_multipart()[-1], 64 << 20))
        return len(got) >= want

    wait_until(more, f"{want} answers")
    return got


def _serves(node: Node) -> bool:
    return node.alive() and node.status().node_id == node.id


def _events(node: Node, name: str) -> list[dict[str, Any]]:
    return [e for e in node.events() if e["event"] == name]


def test_nested_arrays_are_malformed_and_the_daemon_goes_on(cluster: Cluster, dealer: Any) -> None:
    n1 = cluster.spawn("n1")
    sock = dealer(n1.address)
    nested = b"\x91" * 2000 + b"\xc0"  # 2,000 nested one-element arrays in 2 KB
    frames = [
        nested,
        b"\x83\xa1v" + bytes([PROTOCOL_VERSION]) + b"\xa4type\xa4ping\xa1x" + nested,
        b"\x81\xa1v" + nested,
    ]
    for frame in frames:
        answer = _answer(sock, frame)
        assert isinstance(answer, Refusal) and answer.reason == "malformed", answer
    assert _serves(n1)


def test_terms_and_epochs_beyond_two_to_the_53_are_refused(cluster: Cluster, dealer: Any) -> None:
    n1 = cluster.spawn("n1")
    sock = dealer(n1.address)
    huge = 2**64 - 1
    refusal = _frame(type="refusal", sender="n1", epoch=0, reason="stale_term", term=huge)
    report = _frame(
        type="agent_report", sender="n1", epoch=huge, term=1, address=n1.address, joined_at=0.0
    )
    for frame in (refusal, report):
        answer = _answer(sock, frame)
        assert isinstance(answer, Refusal) and answer.reason == "malformed", answer
    st = n1.status()
    assert st.term < 2**53 and st.epoch < 2**53 and st.role == "scheduler"
    assert _serves(n1)


def test_a_flood_of_forged_join_requests_is_rate_limited(cluster: Cluster, dealer: Any) -> None:
    n1 = cluster.spawn("n1")
    sock = dealer(n1.address)
    count = 1500
    for i in range(count):
        sock.send(
            _frame(
                type="join_request",
                sender=f"f{i}",
                epoch=0,
                node_id=f"f{i}",
                address=f"tcp://127.0.0.1:{10000 + i}",
            )
        )
    # a refused join is answered at once; an accepted one only later (or never: nobody is
    # there), so wait for the refusals of all but the accepted burst
    overloaded = [
        a for a in _answers(sock, count // 2) if getattr(a, "reason", None) == "overloaded"
    ]
    assert len(overloaded) >= count // 2
    assert _serves(n1)
    assert _events(n1, "overloaded")
    with n1.local_client() as c:
        assert c.status().node_id == "n1"


def _lower_nofile(pid: int, limit: int) -> None:
    """Lowers a process's open-file limit (soft and hard) to ``limit``."""
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, limit))


def test_many_connect_commands_under_a_low_file_limit(cluster: Cluster, dealer: Any) -> None:
    n1 = cluster.spawn("n1")
    _lower_nofile(n1.proc.pid, 1024)
    local = dealer(n1.ipc)
    assert isinstance(_answer(local, _frame(type="status_request")), msgspec.Struct)
    sock = dealer(n1.address)
    st = n1.status()
    for i in range(3000):
        sock.send(
            _frame(
                type="connect_command",
                sender="n1",
                epoch=st.epoch,
                term=st.term,
                peer=f"p{i}",
                address=f"tcp://127.0.0.1:{20000 + i}",
                measure_bandwidth=False,
            )
        )
    wait_until(lambda: _events(n1, "overloaded"), "the measurement budget to refuse some")
    assert n1.alive()
    assert _answer(local, _frame(type="status_request")).node_id == "n1"
    wait_until(lambda: _serves(n1), "status over TCP")


def test_many_idle_tcp_connections_under_a_low_file_limit(cluster: Cluster, dealer: Any) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"this test process may open only {hard} files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096), hard))
    n1 = cluster.spawn("n1")
    _lower_nofile(n1.proc.pid, 1024)
    local = dealer(n1.ipc)  # connected before the flood: its answers still get through
    assert _answer(local, _frame(type="status_request")).node_id == "n1"
    host, port = n1.address.removeprefix("tcp://").rsplit(":", 1)
    idle: list[socket.socket] = []
    log = n1.run_dir / "stderr.log"
    daemon = psutil.Process(n1.proc.pid)

    def weathered() -> bool:
        """Tops the idle connections up to 1,100 (a busy daemon accepts slowly: the ones the
        backlog refused are tried again); true once the daemon either ran out of descriptors
        (a resource sample failed: it must go on) or shed the idle connections (they never
        complete a handshake: it drops them after its handshake interval)."""
        while len(idle) < 1100:
            s = socket.socket()
            s.settimeout(5.0)
            try:
                s.connect((host, int(port)))
            except OSError:
                s.close()
                break  # the backlog is full: the daemon no longer accepts, as it should
            idle.append(s)
        shed = len(idle) >= 1100 and daemon.num_fds() < 300
        return shed or "resource sample failed" in log.read_text()

    try:
        wait_until(weathered, "the daemon to run out of descriptors or shed the idle ones",
                   timeout_s=90.0)  # fmt: skip
        assert idle
        assert n1.alive()
        assert _answer(local, _frame(type="status_request")).node_id == "n1"
    finally:
        for s in idle:
            s.close()
    wait_until(lambda: _serves(n1), "status over a new TCP connection")


# -- the guards, in process ----------------------------------------------------------------


def test_a_timer_job_that_raises_is_logged_counted_and_the_others_run() -> None:
    seen: list[tuple[str, str]] = []
    timers = Timers(on_error=lambda where, name, exc: seen.append((where, name)))
    ran: list[str] = []

    def boom() -> None:
        raise RuntimeError("a bug")

    assert timers.call("bad", boom) is False
    assert timers.call("good", ran.append, "ok") is True
    assert ran == ["ok"] and seen == [("timer", "bad")] and timers.errors == 1


def test_a_handler_that_raises_is_logged_counted_and_recorded(tmp_path: Path) -> None:
    cfg = DaemonConfig(node_id="a", listen="tcp://127.0.0.1:5000")
    events = EventLog(tmp_path / "events.jsonl", "a")
    ctx, _ = recording_context(cfg)
    ctx = dataclasses.replace(ctx, events=events)
    metrics = ctx.metrics
    d = Dispatcher(ctx, None, None)  # type: ignore[arg-type]

    def boom(msg: Any, reply: Any, now: float) -> None:
        raise ValueError("a bug")

    d.register({Ping: boom})
    d.dispatch(Ping(sender="a", epoch=0, seq=1, t=0.0), None, 0.0)
    events.close()
    assert d.errors == 1 and metrics.errors == {"handler": 1}
    recorded = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "handler_error"]
    assert recorded and recorded[0]["type"] == "ping" and "a bug" in recorded[0]["error"]


def test_the_join_bucket_refills_at_its_rate() -> None:
    bucket = TokenBucket(rate_per_s=2.0, burst=3)
    assert [bucket.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.take(0.5) is True and bucket.take(0.5) is False  # one token per 0.5 s


def test_a_crash_records_the_real_exit_code(tmp_path: Path) -> None:
    from chaos.daemon.node import Daemon

    run_dir = tmp_path / "run"
    cfg = DaemonConfig(node_id="a", listen=free_tcp_address(), run_dir=str(run_dir))
    daemon = Daemon(cfg)

    def crash() -> None:
        raise SystemExit(7)

    daemon._step = crash
    with pytest.raises(SystemExit):
        daemon.run()
    stopped = [e for e in read_events(cfg.resolved_event_log) if e["event"] == "stopped"]
    assert stopped[-1]["exit_code"] == 7


def test_a_loop_step_that_raises_is_survived(tmp_path: Path) -> None:
    from chaos.daemon.node import Daemon

    cfg = DaemonConfig(node_id="a", listen=free_tcp_address(), run_dir=str(tmp_path / "run"))
    daemon = Daemon(cfg)
    real, calls = daemon._step, []

    def flaky() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        if len(calls) > 3:
            daemon.finish(0)
        real()

    daemon._step = flaky
    assert daemon.run() == 0
    names = [e["event"] for e in read_events(cfg.resolved_event_log)]
    assert "loop_error" in names and daemon.metrics.errors == {"loop": 1}


# -- files and endpoints -------------------------------------------------------------------


def test_the_run_directory_must_be_private(tmp_path: Path) -> None:
    fresh = ensure_private_run_dir(tmp_path / "fresh")
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    with pytest.raises(ConfigError, match="open to other users"):
        ensure_private_run_dir(open_dir)
    afile = tmp_path / "file"
    afile.write_text("")
    with pytest.raises(ConfigError, match="not a directory"):
        ensure_private_run_dir(afile)


def test_a_daemon_refuses_to_start_in_an_open_run_directory(tmp_path: Path) -> None:
    import subprocess

    from chaos.launch import daemon_cli, daemon_command, daemon_env

    run_dir = tmp_path / "open"
    run_dir.mkdir()
    run_dir.chmod(0o755)
    argv = daemon_command("a", free_tcp_address())
    res = subprocess.run(
        argv, env=daemon_env(run_dir), capture_output=True, text=True, timeout=60, check=False
    )
    assert res.returncode != 0 and "open to other users" in res.stderr, res.stderr
    assert daemon_cli("status")  # the client side is unchanged


def test_the_event_log_refuses_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("")
    link = tmp_path / "events-a.jsonl"
    os.symlink(target, link)
    with pytest.raises(OSError, match="symlink"):
        EventLog(link, "a")
    log = EventLog(tmp_path / "real.jsonl", "a")
    log.close()
    assert stat.S_IMODE((tmp_path / "real.jsonl").stat().st_mode) & 0o077 == 0


def test_the_metrics_endpoint_binds_loopback(tmp_path: Path) -> None:
    cfg = DaemonConfig(node_id="a", listen="tcp://127.0.0.1:5000")
    assert cfg.resolved_metrics_host == "127.0.0.1"
    assert DaemonConfig(node_id="a", listen="tcp://[::1]:5000").resolved_metrics_host == "::1"
    other = DaemonConfig(node_id="a", listen="tcp://127.0.0.1:5000", metrics_host="127.0.0.2")
    assert other.resolved_metrics_host == "127.0.0.2"
    wide = DaemonConfig(node_id="a", listen="tcp://0.0.0.0:5000", insecure=True, metrics_port=9)
    assert wide.resolved_metrics_host == "127.0.0.1"  # not the listen host


def test_metrics_off_loopback_need_a_cluster_key(tmp_path: Path) -> None:
    for host in ("0.0.0.0", "192.0.2.1"):
        with pytest.raises(ConfigError, match="refusing to serve metrics"):
            DaemonConfig(node_id="a", listen="tcp://127.0.0.1:5000", metrics_port=9,
                         metrics_host=host)  # fmt: skip
    key = ClusterKey.generate().write(tmp_path / "k.key")
    keyed = DaemonConfig(node_id="a", listen="tcp://127.0.0.1:5000", metrics_port=9,
                         metrics_host="0.0.0.0", cluster_key=str(key))  # fmt: skip
    assert keyed.resolved_metrics_host == "0.0.0.0"
