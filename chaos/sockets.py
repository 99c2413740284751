"""Socket options every long-lived TCP socket of Chaos takes.

A peer that lost its route (a partition, a radio gone) never closes its side of a connection:
its close cannot arrive. Without help the other side keeps such a half-open connection, and
its file descriptor, forever. :func:`keep_alive` turns on TCP keepalive, so the kernel probes a
connection that has been idle for :data:`KEEPALIVE_IDLE_S` and drops it after
:data:`KEEPALIVE_COUNT` unanswered probes :data:`KEEPALIVE_INTERVAL_S` apart (about 25 s in
all); ZeroMQ then releases the peer's pipe. A live connection answers every probe, however
slow or busy its link, so a probe never drops one.
"""

from __future__ import annotations

from typing import Any

import zmq

__all__ = ["KEEPALIVE_COUNT", "KEEPALIVE_IDLE_S", "KEEPALIVE_INTERVAL_S", "keep_alive"]

KEEPALIVE_IDLE_S = 10
"""Seconds a connection is idle before the first probe."""

KEEPALIVE_INTERVAL_S = 5
"""Seconds between probes."""

KEEPALIVE_COUNT = 3
"""Unanswered probes after which the connection is dropped."""


def keep_alive(sock: zmq.Socket[Any]) -> None:
    """Turns on TCP keepalive for every connection ``sock`` makes or accepts (set it before
    ``bind`` or ``connect``; it has no effect on ``ipc://`` and ``inproc://`` endpoints)."""
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTERVAL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_COUNT)
