"""A small synchronous client of a daemon's endpoints (CLI, tests, benchmarks, trainer)."""

from __future__ import annotations

import os
import time
from typing import cast

import zmq

from chaos.errors import ChaosTimeout, ProtocolError
from chaos.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    FaultCommand,
    FaultName,
    FaultReply,
    LeaveCommand,
    LinkCommand,
    Message,
    OpResult,
    Refusal,
    StatusReply,
    StatusRequest,
    decode,
    encode,
)


class DaemonClient:
    """Request/reply over a DEALER to a daemon's IPC or TCP endpoint.

    Args:
        endpoint: ``ipc://PATH`` (the local daemon) or ``tcp://HOST:PORT``.
        timeout_s: Default wait for each reply.

    Raises:
        ProtocolError: an ``ipc://`` endpoint whose socket file does not exist.
    """

    def __init__(self, endpoint: str, timeout_s: float = 15.0) -> None:
        if endpoint.startswith("ipc://") and not os.path.exists(endpoint[len("ipc://") :]):
            raise ProtocolError(f"no daemon listening at {endpoint} (no socket file)")
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)

    def request(self, msg: Message, timeout_s: float | None = None) -> Message:
        """Sends one request and waits for its answer.

        Args:
            msg: The request.
            timeout_s: Wait at most this long (default: the client's timeout).

        Returns:
            The answer (possibly a :class:`~chaos.protocol.Refusal`).

        Raises:
            ChaosTimeout: no answer in time.
            ProtocolError: the answer cannot be decoded.
        """
        wait = self.timeout_s if timeout_s is None else timeout_s
        self._sock.send(encode(msg))
        deadline = time.monotonic() + wait
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                raise ChaosTimeout(f"no answer from {self.endpoint} within {wait:.1f} s")
            parts = self._sock.recv_multipart()
            return decode(parts[-1], DEFAULT_MAX_FRAME_BYTES * 4)

    def _expect(self, msg: Message, kind: type, timeout_s: float | None = None) -> Message:
        answer = self.request(msg, timeout_s)
        if isinstance(answer, Refusal):
            raise ProtocolError(f"refused: {answer.reason} {answer.detail}".strip())
        if not isinstance(answer, kind):
            raise ProtocolError(f"unexpected answer {type(answer).__name__}")
        return answer

    def status(self, timeout_s: float | None = None) -> StatusReply:
        """The daemon's status."""
        return cast(StatusReply, self._expect(StatusRequest(), StatusReply, timeout_s))

    def op(self, msg: LeaveCommand | LinkCommand, timeout_s: float | None = None) -> OpResult:
        """Runs a primitive request; returns its result (``ok`` may be ``False``).

        Raises:
            ChaosTimeout: no answer in time.
            ProtocolError: refused (e.g. ``paused``) or an unexpected answer.
        """
        return cast(OpResult, self._expect(msg, OpResult, timeout_s))

    def link(self, peer: str, add: bool, timeout_s: float | None = None) -> OpResult:
        """Adds or removes this daemon's link to ``peer``."""
        return self.op(LinkCommand(peer=peer, op="connect" if add else "disconnect"), timeout_s)

    def leave(self, timeout_s: float | None = None) -> OpResult:
        """Makes the daemon leave the cluster; it exits afterwards."""
        return self.op(LeaveCommand(), timeout_s)

    def fault(
        self, name: FaultName, peers: list[str], timeout_s: float | None = None
    ) -> FaultReply:
        """Injects a named transport fault (``clear`` removes all)."""
        return cast(
            FaultReply, self._expect(FaultCommand(name=name, peers=peers), FaultReply, timeout_s)
        )

    def close(self) -> None:
        """Closes the socket."""
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
