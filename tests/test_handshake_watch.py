"""HandshakeWatch over real sockets: a keyed CURVE server refuses plain clients, and the watch
counts every refusal and reports the first few, then every Mth; a client's watch sees its own
connection refused."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from chaos.security import (
    HANDSHAKE_FAILED_EVENTS,
    ClusterKey,
    HandshakeRefusal,
    HandshakeWatch,
    Security,
    handshake_error,
)

_WAIT_S = 20.0
_KINDS = {"no detail", "protocol", "authentication", "error"}


@pytest.fixture
def keyed_server() -> Iterator[tuple[zmq.Context[zmq.Socket[bytes]], Security]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sec = Security(ClusterKey.generate())
    sec.authenticate(ctx)
    try:
        yield ctx, sec
    finally:
        sec.release(ctx)
        ctx.destroy(linger=0)


def _plain_client(ctx: zmq.Context[zmq.Socket[bytes]], address: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send(b"hello")
    return sock


def _drain_until(watch: HandshakeWatch, failures: int) -> None:
    deadline = time.monotonic() + _WAIT_S
    while watch.failures < failures:
        if time.monotonic() > deadline:
            raise AssertionError(f"only {watch.failures} of {failures} refusals seen")
        if watch.monitor.poll(100, zmq.POLLIN):
            watch.drain()


def test_a_server_watch_counts_every_refusal_and_reports_first_then_every_mth(
    keyed_server: tuple[zmq.Context[zmq.Socket[bytes]], Security],
) -> None:
    ctx, sec = keyed_server
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    sec.server(router)
    counted: list[HandshakeRefusal] = []
    reported: list[HandshakeRefusal] = []
    watch = HandshakeWatch(
        router, on_refused=counted.append, report=reported.append, log_first=2, log_every=3
    )
    router.bind("tcp://127.0.0.1:*")
    address = router.getsockopt_string(zmq.LAST_ENDPOINT)
    clients = [_plain_client(ctx, address) for _ in range(7)]
    _drain_until(watch, 7)
    n = watch.failures
    assert [r.count for r in counted] == list(range(1, n + 1))
    assert [r.count for r in reported] == [c for c in range(1, n + 1) if c <= 2 or c % 3 == 0]
    assert all(r.detail in _KINDS and r.endpoint == address for r in counted), counted
    assert not router.poll(0, zmq.POLLIN)  # no stranger's frame reached the server
    watch.close()
    assert watch.monitor.closed and not router.closed
    for c in clients:
        c.close(linger=0)


def test_a_client_watch_sees_its_connection_refused(
    keyed_server: tuple[zmq.Context[zmq.Socket[bytes]], Security],
) -> None:
    ctx, sec = keyed_server
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    sec.server(router)
    router.bind("tcp://127.0.0.1:*")
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    watch = HandshakeWatch(client)  # before connect: a mechanism mismatch fails only once
    client.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
    assert watch.monitor.poll(int(_WAIT_S * 1000), zmq.POLLIN), "no refusal seen"
    assert watch.pending()
    refusal = watch.take()
    assert refusal is not None and refusal.count == 1 and refusal.detail in _KINDS
    assert watch.failures == 1
    watch.close()
    client.close(linger=0)
    router.close(linger=0)


def test_a_watch_with_no_events_takes_nothing() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        watch = HandshakeWatch(sock, log_first=1)
        assert not watch.pending() and watch.take() is None and watch.drain() == 0
        assert watch.failures == 0
        watch.close()
        sock.close(linger=0)
    finally:
        ctx.destroy(linger=0)


def test_the_event_table_and_the_limits() -> None:
    assert handshake_error(zmq.EVENT_HANDSHAKE_FAILED_AUTH) == "authentication"
    assert handshake_error(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL) == "protocol"
    assert handshake_error(zmq.EVENT_HANDSHAKE_SUCCEEDED) is None
    assert HANDSHAKE_FAILED_EVENTS & zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    assert not HANDSHAKE_FAILED_EVENTS & zmq.EVENT_DISCONNECTED
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        with pytest.raises(ValueError, match="log_first"):
            HandshakeWatch(sock, log_first=-1)
        watch = HandshakeWatch(sock, log_first=5, log_every=1000)
        assert [c for c in range(1, 3001) if watch.logs(c)] == [1, 2, 3, 4, 5, 1000, 2000, 3000]
        watch.close()
        sock.close(linger=0)
    finally:
        ctx.destroy(linger=0)
