"""TCP keepalive on the long-lived sockets: a peer whose route is gone never closes its side, and
only the kernel's probes release such a half-open connection (and its file descriptor). The
user and connect timeouts beside them close a connection stuck retransmitting into a cut (the
behaviour itself, in namespaces: ``tests/emulate/test_stuck_connection.py``)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
from chaos.daemon.transport import FaultInjector, Transport

from chaos.collectives import Communicator, CommunicatorConfig, Topology
from chaos.replication.server import ShardServer
from chaos.sockets import (
    CONNECT_TIMEOUT_S,
    KEEPALIVE_COUNT,
    KEEPALIVE_IDLE_S,
    KEEPALIVE_INTERVAL_S,
    USER_TIMEOUT_S,
    keep_alive,
    user_timeout,
)


def _probes(sock: zmq.Socket) -> tuple[int, int, int, int]:
    opts = (zmq.TCP_KEEPALIVE, zmq.TCP_KEEPALIVE_IDLE, zmq.TCP_KEEPALIVE_INTVL,
            zmq.TCP_KEEPALIVE_CNT)  # fmt: skip
    a, b, c, d = (int(sock.getsockopt(o)) for o in opts)
    return a, b, c, d


EXPECTED = (1, KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT)


def test_keep_alive_sets_the_probes() -> None:
    ctx: zmq.Context = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        assert _probes(sock)[0] != 1
        keep_alive(sock)
        assert _probes(sock) == EXPECTED
        assert KEEPALIVE_IDLE_S + KEEPALIVE_COUNT * KEEPALIVE_INTERVAL_S <= 60
        assert sock.getsockopt(zmq.TCP_MAXRT) == round(USER_TIMEOUT_S * 1000)
        assert sock.getsockopt(zmq.CONNECT_TIMEOUT) == round(CONNECT_TIMEOUT_S * 1000)
    finally:
        sock.close(linger=0)
        ctx.term()


def test_the_data_plane_and_the_shard_server_probe_their_connections() -> None:
    with Communicator(CommunicatorConfig(node_id="a", listen="tcp://127.0.0.1:*")) as a, \
            Communicator(CommunicatorConfig(node_id="b", listen="tcp://127.0.0.1:*")) as b:
        addrs = {"a": a.address, "b": b.address}
        a.update_topology(Topology("ring", ("a", "b"), addrs, 1, ring_order=("a", "b")))
        assert _probes(a._peers._router) == EXPECTED
        link = a._peers.socket("b")
        assert link is not None and _probes(link) == EXPECTED
    with ShardServer() as server:
        assert _probes(server._sock) == EXPECTED


def test_the_daemons_peer_sockets_and_a_notice_socket_probe_their_connections(
    tmp_path: Path,
) -> None:
    """A daemon's DEALERs carry its heartbeats: one cut while sending must be dropped and made
    again, not left retransmitting on a back-off after the link is back (a campaign's member
    stayed unheard by its scheduler for half a minute after a heal)."""
    transport = Transport("tcp://127.0.0.1:*", f"ipc://{tmp_path}/d.ipc", 1 << 20,
                          FaultInjector())  # fmt: skip
    try:
        transport.ensure_peer("p", "tcp://127.0.0.1:9")
        sock = transport.dealers["p"][1]
        assert _probes(sock) == EXPECTED
        assert sock.getsockopt(zmq.TCP_MAXRT) == round(USER_TIMEOUT_S * 1000)
    finally:
        transport.close()
    with Communicator(CommunicatorConfig(node_id="a", listen="tcp://127.0.0.1:*")) as a:
        addrs = {"a": a.address, "b": "tcp://127.0.0.1:9", "c": "tcp://127.0.0.1:10"}
        a.update_topology(Topology("ring", ("a", "b"), addrs, 1, ring_order=("a", "b")))
        notices = a._notices
        notices.retain(addrs, 1)
        notices.tell_newer("c", (1, 0))  # not a neighbour: a notice-only socket
        assert notices.notice_sockets == 1
        (notice,) = notices._sockets.values()
        assert _probes(notice) == EXPECTED


def test_a_plain_socket_gets_the_user_timeout() -> None:
    with socket.socket() as sock:
        user_timeout(sock)
        got = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
        assert got == round(USER_TIMEOUT_S * 1000)


_FIRST_SEND = r"""
import os, sys, zmq
from chaos.sockets import start_zero_copy_collector

def files():
    return len(os.listdir("/proc/self/fd"))

if sys.argv[1] == "start":
    start_zero_copy_collector()
    start_zero_copy_collector()  # idempotent
ctx = zmq.Context()
a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
a.bind("inproc://x")
b.connect("inproc://x")
before = files()
a.send(bytes(1 << 20), copy=False)  # over pyzmq's copy threshold: freed by its collector
b.recv()
print(before, files())
"""


@pytest.mark.parametrize("mode", ["start", "lazy"])
def test_a_first_uncopied_send_opens_no_files_once_the_collector_runs(mode: str) -> None:
    """Started with the process, pyzmq's zero-copy collector adds no descriptors later; left
    to pyzmq, the first uncopied send opens them (a process's files then jump mid-run)."""
    out = subprocess.run([sys.executable, "-c", _FIRST_SEND, mode], capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()  # fmt: skip
    before, after = int(out[0]), int(out[1])
    if mode == "start":
        assert after == before
    else:
        assert after > before  # what the start-up call prevents
