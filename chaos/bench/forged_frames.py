"""Data-plane frames a cluster-key holder forges, and the socket it sends them through.

A key holder has the cluster key but no place in the topology: its CURVE handshake with a
trainer's allreduce endpoint (or shard server) succeeds, with a keypair of its own, and it can
send well-formed frames of any epoch and step under any routing id. :func:`data_frame` builds
one such frame (a valid header and a payload of the size asked); :class:`KeyHolderSocket` is the
DEALER that sends them and reports, from its monitor, whether the endpoint dropped the
connection (a frame over its ``MAXMSGSIZE``). The real-process tests of the data plane's bounds
use them, and so can a key-holder mode of ``chaos-bench fuzz``.
"""

from __future__ import annotations

import time

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from chaos.collectives.frames import Op, encode_header
from chaos.collectives.links import routing_id
from chaos.errors import ChaosTimeout
from chaos.security import Security

__all__ = ["KeyHolderSocket", "data_frame"]

SEND_TIMEOUT_S = 10.0
"""Default longest wait for one send to be queued."""


def data_frame(epoch: int, step: int, payload_bytes: int, *, op: Op = Op.TREE_UP,
               chunk: int = 0, payload: bytes | None = None) -> list[bytes]:  # fmt: skip
    """The parts of one float32 data frame of ``(epoch, step)``: its header and its payload.

    Args:
        epoch: The topology epoch it claims (any 64-bit value: e.g. far in the future).
        step: The step it claims.
        payload_bytes: The payload's size (a multiple of 4; its elements are zeros).
        op: The frame's op (a data op by default).
        chunk: The chunk index it claims.
        payload: A ready payload of ``payload_bytes`` to send instead (reuse one large buffer
            for many frames).

    Raises:
        ValueError: a size that is not a multiple of 4, or a payload of another size.
    """
    if payload_bytes < 0 or payload_bytes % 4:
        raise ValueError(f"payload_bytes must be a multiple of 4, got {payload_bytes}")
    if payload is not None and len(payload) != payload_bytes:
        raise ValueError(f"payload is {len(payload)} bytes, expected {payload_bytes}")
    header = encode_header(op, torch.float32, 0, epoch, step, chunk, payload_bytes // 4)
    return [header, payload if payload is not None else bytes(payload_bytes)]


class KeyHolderSocket:
    """A DEALER connected to ``address`` as a CURVE client with ``security``'s cluster key and
    keypair (plain without a key), under a fresh routing id of ``claim``.

    Args:
        address: The endpoint (a trainer's allreduce endpoint or shard server).
        security: The key holder's security (``Security(cluster_key)``: a keypair of its own).
        claim: The member id its routing id claims (a member's, or one no member has).
    """

    def __init__(self, address: str, security: Security | None, claim: str = "mallory") -> None:
        self.address = address
        self._ctx: zmq.Context = zmq.Context()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, routing_id(claim))
        if security is not None:
            security.client(self.sock)
        self._monitor = self.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        )
        self.handshakes = 0
        """Handshakes completed so far (one per connection the endpoint accepted)."""
        self.drops = 0
        """Connections of this socket that ended so far."""
        self.sock.connect(address)

    def _drain(self, timeout_s: float) -> None:
        """Counts the monitor's events that arrive within ``timeout_s``."""
        if self._monitor.poll(max(0, int(timeout_s * 1000))):
            while self._monitor.poll(0):
                event = recv_monitor_message(self._monitor)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.handshakes += 1
                elif event == zmq.EVENT_DISCONNECTED:
                    self.drops += 1

    def wait_for(self, what: str, count: int, timeout_s: float) -> None:
        """Waits until ``handshakes`` or ``drops`` (``what``) reaches ``count``.

        Raises:
            ChaosTimeout: it did not within ``timeout_s``.
            ValueError: ``what`` is neither.
        """
        if what not in ("handshakes", "drops"):
            raise ValueError(f"what must be 'handshakes' or 'drops', not {what!r}")
        deadline = time.monotonic() + timeout_s
        while getattr(self, what) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChaosTimeout(f"{self.address}: {what} stayed at {getattr(self, what)} "
                                   f"(awaited {count}) for {timeout_s} s")  # fmt: skip
            self._drain(min(left, 0.2))

    def send(self, parts: list[bytes], timeout_s: float = SEND_TIMEOUT_S) -> None:
        """Queues one message (its parts are sent without a copy).

        Raises:
            ChaosTimeout: the queue stayed full for ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.sock.send_multipart(parts, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                if time.monotonic() >= deadline:
                    raise ChaosTimeout(f"{self.address}: a send stayed queued for "
                                       f"{timeout_s} s") from None  # fmt: skip
                self._drain(0.05)

    def close(self) -> None:
        """Closes the socket, its monitor and its context."""
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> KeyHolderSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
