"""The daemon's flows and their handler tables (:mod:`chaos.daemon.node`).

Every message type a daemon takes has exactly one handler, in the table of the one flow that
owns it; the answers only a client takes have none. A message type added to the protocol and
to no flow fails here, instead of being dropped by the running daemon.
"""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
from chaos.daemon.config import DaemonConfig
from chaos.daemon.dispatch import CLIENT_ONLY, DuplicateHandler, merge_handlers

from chaos.launch import free_tcp_address
from chaos.protocol import Message, Ping, Pong


def _daemon(tmp_path: Path) -> typing.Any:
    from chaos.daemon.node import Daemon

    cfg = DaemonConfig(node_id="a", listen=free_tcp_address(), run_dir=str(tmp_path / "run"))
    return Daemon(cfg)


def test_every_message_a_daemon_takes_has_one_handler(tmp_path: Path) -> None:
    daemon = _daemon(tmp_path)
    try:
        handled = set(daemon.dispatcher.handlers)
        every = set(typing.get_args(Message))
        assert handled | set(CLIENT_ONLY) == every, sorted(
            t.__name__ for t in every ^ (handled | set(CLIENT_ONLY))
        )
        assert not handled & set(CLIENT_ONLY)
    finally:
        daemon.transport.close(linger_s=0.0)
        daemon.metrics.close()
        daemon.ctx.events.close()


def test_two_flows_cannot_take_the_same_message() -> None:
    def handler(msg: object, reply: object, now: float) -> None:
        pass

    merged = merge_handlers({Ping: handler}, {Pong: handler})
    assert set(merged) == {Ping, Pong}
    with pytest.raises(DuplicateHandler, match="Ping"):
        merge_handlers({Ping: handler}, {Pong: handler}, {Ping: handler})
