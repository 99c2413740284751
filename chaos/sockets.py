"""Socket options every long-lived TCP socket of Chaos takes.

A peer that lost its route (a partition, a radio gone) never closes its side of a connection:
its close cannot arrive. Without help the other side keeps such a half-open connection, and
its file descriptor, forever. :func:`keep_alive` turns on TCP keepalive, so the kernel probes a
connection that has been idle for :data:`KEEPALIVE_IDLE_S` and drops it after
:data:`KEEPALIVE_COUNT` unanswered probes :data:`KEEPALIVE_INTERVAL_S` apart (about 25 s in
all); ZeroMQ then releases the peer's pipe. A live connection answers every probe, however
slow or busy its link, so a probe never drops one.

Keepalive only probes an *idle* connection. One that was sending when its link went down holds
unacknowledged data, and the kernel retransmits it with a timeout that doubles each time, for
about 15 minutes. When the link comes back a minute later, the next retransmission can still be
a minute away: the connection is up again but carries nothing, and a round over it waits for
the step timeout (a fault campaign showed rounds in which every member waited that long). So
every such connection also gets a *user timeout* (``TCP_USER_TIMEOUT``, ZeroMQ's
``TCP_MAXRT``): data left unacknowledged for :data:`USER_TIMEOUT_S` closes the connection, and
ZeroMQ connects again at once. A connection attempt gets :data:`CONNECT_TIMEOUT_S` for the same
reason (a SYN retransmitted into a cut backs off the same way). A slow link still acknowledges
what gets through, so neither ever closes a connection that is moving data.

A process that sends without copying (``copy=False``) needs pyzmq's zero-copy collector: a
thread with a ZeroMQ context of its own (about seven descriptors) that pyzmq otherwise starts
at the first such send, perhaps hours into a run. :func:`start_zero_copy_collector` starts it
with the process's sockets, so its open files are set from the start and follow only its peers:
growth at equal load is then a leak, never a late first send.
"""

from __future__ import annotations

import socket
from typing import Any

import zmq

__all__ = [
    "CONNECT_TIMEOUT_S",
    "KEEPALIVE_COUNT",
    "KEEPALIVE_IDLE_S",
    "KEEPALIVE_INTERVAL_S",
    "USER_TIMEOUT_S",
    "keep_alive",
    "start_zero_copy_collector",
    "user_timeout",
]

KEEPALIVE_IDLE_S = 10
"""Seconds a connection is idle before the first probe."""

KEEPALIVE_INTERVAL_S = 5
"""Seconds between probes."""

KEEPALIVE_COUNT = 3
"""Unanswered probes after which the connection is dropped."""


USER_TIMEOUT_S = 10.0
"""Seconds sent data may stay unacknowledged before its connection is closed (and made again).
Well above any queueing delay of a working link, well below a step timeout."""

CONNECT_TIMEOUT_S = 3.0
"""Seconds a ZeroMQ connection attempt may take before it is abandoned and tried again."""


def _ms(seconds: float) -> int:
    return int(round(seconds * 1000))


def keep_alive(sock: zmq.Socket[Any]) -> None:
    """Turns on TCP keepalive, the user timeout and the connect timeout for every connection
    ``sock`` makes or accepts (set it before ``bind`` or ``connect``; it has no effect on
    ``ipc://`` and ``inproc://`` endpoints)."""
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTERVAL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_COUNT)
    sock.setsockopt(zmq.TCP_MAXRT, _ms(USER_TIMEOUT_S))  # TCP_USER_TIMEOUT on Linux
    sock.setsockopt(zmq.CONNECT_TIMEOUT, _ms(CONNECT_TIMEOUT_S))


def user_timeout(sock: socket.socket) -> None:
    """Gives a plain TCP socket the user timeout of :func:`keep_alive` (a no-op where the
    platform has no ``TCP_USER_TIMEOUT``)."""
    opt = getattr(socket, "TCP_USER_TIMEOUT", None)
    if opt is not None:
        sock.setsockopt(socket.IPPROTO_TCP, opt, _ms(USER_TIMEOUT_S))


def start_zero_copy_collector() -> None:
    """Starts pyzmq's zero-copy collector thread now, if it is not running (idempotent).

    pyzmq frees a buffer sent with ``copy=False`` on a thread of its own, with a ZeroMQ context
    of its own, that it starts at the first such send. Every long-running process of Chaos
    that sends without copying (the daemon, a trainer's data plane and shard server) calls
    this at start-up, so those descriptors are counted from the start (see the module doc).
    """
    from zmq.utils.garbage import gc

    with gc._lock:  # the lock pyzmq's own lazy start takes
        if not gc.is_alive():
            gc.start()
    gc._push_socket  # noqa: B018 (opens the socket that uncopied sends' destructors use)
