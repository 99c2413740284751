"""What crosses a payload lane's connection: offers, hellos, and the sockets' options.

A lane (see :mod:`chaos.collectives.lanes`) is set up by an offer that travels over ZeroMQ and
a hello that opens the TCP connection; every format here is versioned in :mod:`chaos.wire`.

Hello (little-endian): ``b"CHLN"``, u8 :data:`LANE_VERSION`, u64 token, u8 id length, the id
(utf-8), answered by the one byte :data:`ACK` once accepted (the sender uses the lane only
then, so no frame is written into a connection the receiver refuses). Offer payload: u16 port,
u64 token.

**Sealed lanes** (a communicator with a cluster key, ``Lanes(sealed=True)``): the offer, which
travels inside the CURVE-encrypted ZeroMQ link, also carries a fresh random 32-byte lane key,
and every byte on the lane is an AES-256-GCM record under that key
(:class:`~chaos.collectives.lane_crypto.LaneCipher`): the hello (``b"CHLS"``, u8 version, u32
attempt, u16 sealed length, then the sealed token and id, the 11 clear bytes authenticated as
associated data), the acknowledgement, and each frame's header and payload as two records. A
record's nonce is its direction, the connection's attempt number and a counter of that
direction's records; the sender numbers its connections to one offer 0, 1, ... and the
receiver accepts each attempt of a key at most once, so no nonce is used twice with a key and a
recorded lane cannot be replayed. The token alone is useless without the key, and a record that
fails authentication (tampered, injected or replayed) closes the lane like a malformed frame.
The receiver finds the offer a hello answers by opening it with each current offer's key:
nothing on the lane names the peer in clear.
"""

from __future__ import annotations

import socket
import struct

from chaos.collectives.frames import HEADER_BYTES
from chaos.collectives.lane_crypto import TAG_BYTES, LaneCipher
from chaos.errors import ProtocolError
from chaos.sockets import user_timeout
from chaos.wire import LANE_HELLO as _HELLO
from chaos.wire import LANE_HELLO_BODY as _HELLO_BODY
from chaos.wire import LANE_MAGIC as _MAGIC
from chaos.wire import LANE_OFFER as _OFFER
from chaos.wire import LANE_SEALED_HELLO as _SEALED_HELLO
from chaos.wire import LANE_SEALED_MAGIC as _SEALED_MAGIC
from chaos.wire import LANE_SEALED_OFFER as _SEALED_OFFER
from chaos.wire import LANE_VERSION

__all__ = [
    "ACK", "LANE_VERSION", "MAX_ID", "MAX_SEALED_BODY", "SEALED_ACK", "SEALED_HEADER",
    "decode_offer", "decode_sealed_offer", "encode_hello", "encode_offer", "encode_sealed_hello",
    "encode_sealed_offer", "flat", "set_timeo", "tune_socket",
]  # fmt: skip

ACK = b"\x01"
"""The receiver's answer to a hello it accepts (sealed as one record on a sealed lane)."""
MAX_ID = 255
"""Longest node id a hello carries, in bytes."""
SEALED_HEADER = HEADER_BYTES + TAG_BYTES
"""A sealed frame header's record."""
SEALED_ACK = len(ACK) + TAG_BYTES
"""A sealed acknowledgement's record."""
MAX_SEALED_BODY = _HELLO_BODY.size + MAX_ID + TAG_BYTES
"""Largest sealed part of a sealed hello."""


def encode_offer(port: int, token: int) -> bytes:
    """The payload of an ``Op.LANE`` offer."""
    return _OFFER.pack(port, token)


def encode_sealed_offer(port: int, token: int, key: bytes) -> bytes:
    """The payload of an ``Op.LANE`` offer of a sealed lane (it carries the lane key, so it
    must travel only inside an encrypted link)."""
    return _SEALED_OFFER.pack(port, token, key)


def decode_sealed_offer(raw: bytes | memoryview) -> tuple[int, int, bytes]:
    """``(port, token, key)`` of a sealed lane's offer.

    Raises:
        ProtocolError: wrong size (e.g. an offer without a key) or port 0.
    """
    if len(raw) != _SEALED_OFFER.size:
        raise ProtocolError(f"sealed lane offer is {len(raw)} bytes, expected "
                            f"{_SEALED_OFFER.size}")  # fmt: skip
    port, token, key = _SEALED_OFFER.unpack(raw)
    if port == 0:
        raise ProtocolError("lane offer names port 0")
    return int(port), int(token), bytes(key)


def decode_offer(raw: bytes | memoryview) -> tuple[int, int]:
    """``(port, token)`` of an offer.

    Raises:
        ProtocolError: wrong size or port 0.
    """
    if len(raw) != _OFFER.size:
        raise ProtocolError(f"lane offer is {len(raw)} bytes, expected {_OFFER.size}")
    port, token = _OFFER.unpack(raw)
    if port == 0:
        raise ProtocolError("lane offer names port 0")
    return int(port), int(token)


def encode_hello(node_id: str, token: int) -> bytes:
    """The first bytes an :class:`OutLane` sends.

    Raises:
        ValueError: the node id is longer than 255 bytes.
    """
    raw = node_id.encode()
    if not 0 < len(raw) <= MAX_ID:
        raise ValueError("a lane hello needs a node id of 1 to 255 bytes")
    return _HELLO.pack(_MAGIC, LANE_VERSION, token, len(raw)) + raw


def encode_sealed_hello(node_id: str, token: int, cipher: LaneCipher, attempt: int) -> bytes:
    """The first bytes of a sealed lane: the clear prefix, then the token and id sealed with
    ``cipher`` (the connection's :data:`TO_RECEIVER` cipher, whose first record it is).

    Raises:
        ValueError: the node id is longer than 255 bytes.
    """
    raw = node_id.encode()
    if not 0 < len(raw) <= MAX_ID:
        raise ValueError("a lane hello needs a node id of 1 to 255 bytes")
    body = _HELLO_BODY.pack(token, len(raw)) + raw
    prefix = _SEALED_HELLO.pack(_SEALED_MAGIC, LANE_VERSION, attempt, len(body) + TAG_BYTES)
    return prefix + cipher.seal(body, prefix)


def set_timeo(sock: socket.socket, option: int, seconds: float) -> None:
    """Kernel send/receive timeout of a blocking socket (``SO_SNDTIMEO``/``SO_RCVTIMEO``)."""
    sec = int(seconds)
    usec = int((seconds - sec) * 1e6)
    if sec == 0 and usec == 0:
        usec = 1  # zero would mean "no timeout"
    sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", sec, usec))


def tune_socket(sock: socket.socket) -> None:
    """No Nagle delay, and the user timeout every long-lived connection takes
    (:func:`chaos.sockets.user_timeout`: a lane stuck after a cut closes and falls back)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    user_timeout(sock)


def flat(view: memoryview) -> memoryview:
    """``view`` as flat bytes."""
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
