"""Fuzzing the payload lanes (:mod:`chaos.collectives.lanes`): the offer, the hello a listener
reads from a raw TCP connection, and the data frames read from a greeted lane.

The contracts: :func:`~chaos.collectives.lanes.decode_offer` returns ``(port, token)`` or raises
:class:`~chaos.errors.ProtocolError`; a listener accepts a connection only with the exact hello
of a current offer and refuses (closes) anything else without raising;
:func:`~chaos.collectives.lanes.read_frame` returns a frame or says why there is none
(``"closed"``, ``"timeout"``, ``"malformed: ..."``) and never raises.
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Iterator

import pytest
import torch
from fuzz_strategies import byte_mutations
from hypothesis import given, settings
from hypothesis import strategies as st

from chaos.collectives.frames import DATA_OPS, HEADER_BYTES, Header, Op, encode_header
from chaos.collectives.lane_crypto import TO_RECEIVER as _TO_RECEIVER
from chaos.collectives.lanes import (
    LANE_KEY_BYTES,
    InLane,
    LaneCipher,
    Lanes,
    decode_offer,
    decode_sealed_offer,
    encode_hello,
    encode_offer,
    encode_sealed_hello,
    encode_sealed_offer,
    read_frame,
)
from chaos.collectives.links import Frame
from chaos.errors import ProtocolError
from chaos.wire import LANE_HELLO, LANE_MAGIC, LANE_OFFER, LANE_SEALED_OFFER, LANE_VERSION

_PEER = "peer-1"
_MAX_BYTES = 4096


# ----------------------------------------------------------------------------- offers


@settings(max_examples=300)
@given(raw=st.binary(max_size=2 * LANE_OFFER.size))
def test_offer_random_bytes(raw: bytes) -> None:
    try:
        port, token = decode_offer(raw)
    except ProtocolError:
        return
    assert len(raw) == LANE_OFFER.size and 0 < port < 65536 and 0 <= token < 2**64


@settings(max_examples=200)
@given(data=st.data(), port=st.integers(1, 65535), token=st.integers(0, 2**64 - 1))
def test_offer_mutations(data: st.DataObject, port: int, token: int) -> None:
    assert decode_offer(encode_offer(port, token)) == (port, token)
    raw = data.draw(byte_mutations(encode_offer(port, token)))
    try:
        decode_offer(memoryview(raw))
    except ProtocolError:
        pass


# ----------------------------------------------------------------------------- hellos


@pytest.fixture(scope="module")
def lanes() -> Iterator[Lanes]:
    lanes = Lanes("me", "127.0.0.1", connect_timeout_s=2.0, slice_s=0.05)
    try:
        yield lanes
    finally:
        lanes.close()


def _pump(lanes: Lanes, until_s: float) -> None:
    """Polls the listener and the pending connections once (at most ``until_s``)."""
    socks = list(lanes.poll_sockets())
    ready, _, _ = select.select([s.fileno() for s in socks], [], [], until_s)
    lanes.on_readable(set(ready))


def _greet(lanes: Lanes, raw: bytes, split: int) -> bool:
    """Connects to ``lanes``, sends ``raw`` in two pieces and ends the stream; returns whether
    the listener accepted the connection as the lane of :data:`_PEER`."""
    rejected = lanes.rejected
    with socket.create_connection(("127.0.0.1", lanes.port), timeout=2.0) as client:
        client.sendall(raw[:split])
        _pump(lanes, 0.01)
        if raw[split:]:
            client.sendall(raw[split:])
        client.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + 5.0
        while _PEER not in lanes.incoming and lanes.rejected == rejected:
            if time.monotonic() > deadline:
                pytest.fail(f"the listener neither accepted nor refused {raw!r}")
            _pump(lanes, 0.05)
    accepted = _PEER in lanes.incoming
    lanes.close_incoming(_PEER)  # forgets the token too: the next offer has a new one
    return accepted


def _token(lanes: Lanes) -> int:
    return decode_offer(lanes.offer(_PEER))[1]


def test_the_valid_hello_is_accepted(lanes: Lanes) -> None:
    assert _greet(lanes, encode_hello(_PEER, _token(lanes)), 3)


@settings(max_examples=150)
@given(data=st.data(), split=st.integers(0, 64))
def test_hello_mutations(lanes: Lanes, data: st.DataObject, split: int) -> None:
    hello = encode_hello(_PEER, _token(lanes))
    raw = data.draw(byte_mutations(hello))
    assert _greet(lanes, raw, split) == raw.startswith(hello)


@settings(max_examples=100)
@given(raw=st.binary(max_size=300), split=st.integers(0, 300))
def test_hello_random_bytes(lanes: Lanes, raw: bytes, split: int) -> None:
    _token(lanes)
    assert not _greet(lanes, raw, split)


@settings(max_examples=100)
@given(
    magic=st.sampled_from([LANE_MAGIC, b"CHLM", b"\x00" * 4]),
    version=st.integers(0, 255),
    n=st.integers(0, 255),
    name=st.binary(max_size=255),
    right_token=st.booleans(),
)
def test_hello_fields(
    lanes: Lanes, magic: bytes, version: int, n: int, name: bytes, right_token: bool
) -> None:
    token = _token(lanes) if right_token else 12345
    raw = LANE_HELLO.pack(magic, version, token, n) + name
    want = (magic, version, n, name[:n], right_token) == (
        LANE_MAGIC,
        LANE_VERSION,
        len(_PEER),
        _PEER.encode(),
        True,
    )
    assert _greet(lanes, raw, 5) == want


def test_many_silent_connections_are_dropped(lanes: Lanes) -> None:
    """More connections owing a hello than the listener keeps: the oldest are refused."""
    rejected = lanes.rejected
    clients = []
    try:
        for _ in range(80):
            clients.append(socket.create_connection(("127.0.0.1", lanes.port), timeout=2.0))
            _pump(lanes, 0.0)
        deadline = time.monotonic() + 5.0
        while lanes.rejected - rejected < 16 and time.monotonic() < deadline:
            _pump(lanes, 0.05)
        assert lanes.rejected - rejected >= 16
    finally:
        for c in clients:
            c.close()
        deadline = time.monotonic() + 5.0
        while len(list(lanes.poll_sockets())) > 1 + len(lanes.incoming):
            if time.monotonic() > deadline:
                break
            _pump(lanes, 0.05)


# ----------------------------------------------------------------------------- data frames

_KEY = (3, 9)
_VALID_FRAMES = [
    encode_header(op, torch.float32, 0, *_KEY, 0, 16) + bytes(range(64))
    for op in (Op.RING_REDUCE_SCATTER, Op.TREE_UP, Op.ABORT, Op.LANE)
] + [encode_header(Op.TREE_DOWN, torch.float64, 0, 3, 10, 1, 2) + b"\x01" * 16]


def _read(raw: bytes, placed: bool) -> Frame | str:
    """Writes ``raw`` into one end of a socket pair, ends the stream, and reads one frame from
    the other end as a lane."""
    a, b = socket.socketpair()
    dest = bytearray(_MAX_BYTES)

    def place(peer: str, header: Header) -> memoryview | None:
        n = header.nelem * header.dtype.itemsize
        return memoryview(dest)[:n] if placed else None

    with a, b:
        a.sendall(raw)
        a.shutdown(socket.SHUT_WR)
        got = read_frame(
            InLane(_PEER, b), _KEY, time.monotonic() + 2.0, 0.05, place, _MAX_BYTES, lambda: None
        )
    if isinstance(got, Frame):
        assert got.header.op in DATA_OPS
        assert len(raw) >= HEADER_BYTES + got.header.nelem * got.header.dtype.itemsize
    else:
        assert got in ("closed", "timeout") or got.startswith("malformed: "), got
    return got


@settings(max_examples=300)
@given(raw=st.binary(max_size=200), placed=st.booleans())
def test_frame_random_bytes(raw: bytes, placed: bool) -> None:
    _read(raw, placed)


@settings(max_examples=300)
@given(data=st.data(), i=st.integers(0, len(_VALID_FRAMES) - 1), placed=st.booleans())
def test_frame_mutations(data: st.DataObject, i: int, placed: bool) -> None:
    _read(data.draw(byte_mutations(_VALID_FRAMES[i])), placed)


def test_valid_frames() -> None:
    assert isinstance(_read(_VALID_FRAMES[0], True), Frame)
    assert isinstance(_read(_VALID_FRAMES[-1], False), Frame)
    assert _read(_VALID_FRAMES[2], False).startswith("malformed: ")  # an abort on a lane


def test_oversized_frame_is_malformed() -> None:
    raw = encode_header(Op.TREE_UP, torch.float64, 0, *_KEY, 0, 2**32 - 1)
    assert _read(raw, False) == f"malformed: TREE_UP frame of {(2**32 - 1) * 8} bytes on a lane"


# ----------------------------------------------------------------------------- sealed lanes


@settings(max_examples=200)
@given(raw=st.binary(max_size=2 * LANE_SEALED_OFFER.size))
def test_sealed_offer_random_bytes(raw: bytes) -> None:
    try:
        port, _token, key = decode_sealed_offer(raw)
    except ProtocolError:
        return
    assert len(raw) == LANE_SEALED_OFFER.size and 0 < port and len(key) == LANE_KEY_BYTES


@settings(max_examples=100)
@given(data=st.data(), port=st.integers(1, 65535), token=st.integers(0, 2**64 - 1))
def test_sealed_offer_mutations(data: st.DataObject, port: int, token: int) -> None:
    key = bytes(range(32))
    assert decode_sealed_offer(encode_sealed_offer(port, token, key)) == (port, token, key)
    try:
        decode_sealed_offer(data.draw(byte_mutations(encode_sealed_offer(port, token, key))))
    except ProtocolError:
        pass


@pytest.fixture(scope="module")
def sealed_lanes() -> Iterator[Lanes]:
    lanes = Lanes("me", "127.0.0.1", connect_timeout_s=2.0, slice_s=0.05, sealed=True)
    try:
        yield lanes
    finally:
        lanes.close()


def _sealed_hello(lanes: Lanes, attempt: int) -> bytes:
    _port, token, key = decode_sealed_offer(lanes.offer(_PEER))
    return encode_sealed_hello(_PEER, token, LaneCipher(key, attempt, _TO_RECEIVER), attempt)


def test_the_valid_sealed_hello_is_accepted(sealed_lanes: Lanes) -> None:
    assert _greet(sealed_lanes, _sealed_hello(sealed_lanes, 0), 3)


@settings(max_examples=150)
@given(data=st.data(), split=st.integers(0, 64), attempt=st.integers(0, 2**24 - 1))
def test_sealed_hello_mutations(
    sealed_lanes: Lanes, data: st.DataObject, split: int, attempt: int
) -> None:
    hello = _sealed_hello(sealed_lanes, attempt)
    raw = data.draw(byte_mutations(hello))
    assert _greet(sealed_lanes, raw, split) == raw.startswith(hello)


@settings(max_examples=100)
@given(raw=st.binary(max_size=300), split=st.integers(0, 300))
def test_sealed_hello_random_bytes(sealed_lanes: Lanes, raw: bytes, split: int) -> None:
    decode_sealed_offer(sealed_lanes.offer(_PEER))
    assert not _greet(sealed_lanes, raw, split)


def test_a_plain_hello_is_refused_by_a_sealed_listener(sealed_lanes: Lanes) -> None:
    _port, token, _key = decode_sealed_offer(sealed_lanes.offer(_PEER))
    assert not _greet(sealed_lanes, encode_hello(_PEER, token), 3)


_LANE_KEY = bytes(range(32))


def _sealed_stream(frame: bytes, attempt: int = 0) -> bytes:
    """A plain lane frame (header, payload) as a sealed lane carries it."""
    cipher = LaneCipher(_LANE_KEY, attempt, _TO_RECEIVER)
    return cipher.seal(frame[:HEADER_BYTES]) + cipher.seal(frame[HEADER_BYTES:])


def _read_sealed(raw: bytes) -> Frame | str:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(raw)
        a.shutdown(socket.SHUT_WR)
        lane = InLane(_PEER, b, LaneCipher(_LANE_KEY, 0, _TO_RECEIVER))
        got = read_frame(lane, _KEY, time.monotonic() + 2.0, 0.05, None, _MAX_BYTES, lambda: None)
    if not isinstance(got, Frame):
        assert got in ("closed", "timeout") or got.startswith("malformed: "), got
    return got


def test_a_valid_sealed_frame_is_read() -> None:
    assert isinstance(_read_sealed(_sealed_stream(_VALID_FRAMES[0])), Frame)


@settings(max_examples=200)
@given(data=st.data(), i=st.integers(0, len(_VALID_FRAMES) - 1))
def test_sealed_frame_mutations(data: st.DataObject, i: int) -> None:
    valid = _sealed_stream(_VALID_FRAMES[i])
    raw = data.draw(byte_mutations(valid))
    got = _read_sealed(raw)
    if isinstance(got, Frame):
        assert raw.startswith(valid)


@settings(max_examples=100)
@given(raw=st.binary(max_size=200))
def test_sealed_frame_random_bytes(raw: bytes) -> None:
    assert not isinstance(_read_sealed(raw), Frame)
