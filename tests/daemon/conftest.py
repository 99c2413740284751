"""Fixtures for the daemon tests (helpers live in ``daemon_helpers``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from daemon_helpers import Cluster


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A cluster whose processes are killed and reaped even when the test fails."""
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def dealer() -> Iterator[Any]:
    """Opens raw DEALERs to a daemon's endpoints; all closed at the end."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socks: list[zmq.Socket[bytes]] = []

    def open_to(endpoint: str) -> zmq.Socket[bytes]:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        socks.append(s)
        return s

    yield open_to
    for s in socks:
        s.close(linger=0)
    ctx.term()
