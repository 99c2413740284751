"""TCP keepalive on the long-lived sockets: a peer whose route is gone never closes its side, and
only the kernel's probes release such a half-open connection (and its file descriptor). The
user and connect timeouts beside them close a connection stuck retransmitting into a cut (the
behaviour itself, in namespaces: ``tests/emulate/test_stuck_connection.py``)."""

from __future__ import annotations

import socket

import zmq

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


def test_a_plain_socket_gets_the_user_timeout() -> None:
    with socket.socket() as sock:
        user_timeout(sock)
        got = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
        assert got == round(USER_TIMEOUT_S * 1000)
