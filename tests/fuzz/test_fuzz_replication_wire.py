"""Fuzzing the replication wire (:mod:`chaos.replication.wire`).

The contract: :func:`~chaos.replication.wire.validate_request` never raises (a bad request is a
:class:`~chaos.protocol.messages.Refusal`), and a joiner's
:data:`~chaos.replication.wire.REPLY_DECODER` raises nothing but :class:`msgspec.DecodeError`.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from fuzz_strategies import (
    byte_mutations,
    deep_array,
    deep_field,
    deep_map,
    field_mutations,
    msgpack_values,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from chaos.protocol.messages import Reason, Refusal
from chaos.replication import wire

REQUESTS = [
    wire.ManifestRequest(req_id=1, epoch=3),
    wire.ManifestRequest(req_id=2, epoch=3, step=9, newer_ok=True),
    wire.ShardRequest(
        req_id=3,
        epoch=3,
        step=9,
        fingerprint="ab" * 32,
        digest="cd" * 32,
        offset=4096,
        length=1 << 20,
    ),
    wire.StepLogRequest(req_id=4, from_step=9, max_entries=16),
]
REPLIES = [
    wire.ManifestReply(req_id=1, epoch=3, step=9, digest="cd" * 32),
    wire.ShardReply(req_id=3, epoch=3, step=9, offset=4096, length=1 << 20, checksum=2**64 - 1),
    wire.refusal(3, Reason.OUT_OF_RANGE, "past the end"),
    wire.StepLogReply(
        req_id=4,
        start=9,
        head=12,
        closed_at=12,
        entries=[wire.StepEntry(step=9, nbytes=1 << 20, hypers=b"\x91\x81\xa2lr\xcb?\xb9")],
    ),
]
_FRAMES = [wire.WIRE_ENCODER.encode(x) for x in [*REQUESTS, *REPLIES]]
_MAPS: list[dict[str, Any]] = [msgspec.msgpack.decode(f) for f in _FRAMES]


def _check(frame: bytes) -> None:
    got = wire.validate_request([frame])
    if isinstance(got, Refusal):
        assert isinstance(got.reason, Reason)
        assert got.v == wire.REPLICATION_VERSION
        # the refusal the server answers with must be readable by the joiner
        assert wire.REPLY_DECODER.decode(wire.WIRE_ENCODER.encode(got)) == got
    else:
        assert isinstance(got, (wire.ManifestRequest, wire.ShardRequest, wire.StepLogRequest))
    try:
        wire.REPLY_DECODER.decode(frame)
    except msgspec.DecodeError:
        pass


def test_examples_round_trip() -> None:
    for msg, frame in zip(REQUESTS, _FRAMES, strict=False):
        assert wire.validate_request([frame]) == msg
    for msg, frame in zip(REPLIES, _FRAMES[len(REQUESTS) :], strict=True):
        assert wire.REPLY_DECODER.decode(frame) == msg


@settings(max_examples=300)
@given(frame=st.binary(max_size=512))
def test_random_bytes(frame: bytes) -> None:
    _check(frame)


@settings(max_examples=300)
@given(frame=msgpack_values)
def test_random_msgpack(frame: bytes) -> None:
    _check(frame)


@settings(max_examples=300)
@given(data=st.data(), i=st.integers(0, len(_FRAMES) - 1))
def test_byte_mutations(data: st.DataObject, i: int) -> None:
    _check(data.draw(byte_mutations(_FRAMES[i])))


@settings(max_examples=300)
@given(data=st.data(), i=st.integers(0, len(_MAPS) - 1))
def test_field_mutations(data: st.DataObject, i: int) -> None:
    _check(data.draw(field_mutations(_MAPS[i])))


@settings(max_examples=50)
@given(frames=st.lists(st.binary(max_size=16), max_size=4))
def test_frame_counts(frames: list[bytes]) -> None:
    got = wire.validate_request(frames)
    if len(frames) != 1:
        assert isinstance(got, Refusal) and got.reason == Reason.MALFORMED


def test_oversized() -> None:
    got = wire.validate_request([b"\x00" * (wire.MAX_REQUEST_BYTES + 1)])
    assert isinstance(got, Refusal) and got.reason == Reason.TOO_LARGE


@pytest.mark.parametrize("depth", [100, 1000, 4000])
def test_deep_nesting(depth: int) -> None:
    _check(deep_array(depth))
    _check(deep_map(depth // 3))
    for base in _MAPS:
        _check(deep_field(base, "extra", depth))
        _check(deep_field(base, "epoch", depth))


def test_not_utf8() -> None:
    for base in _MAPS:
        frame = msgspec.msgpack.encode({**base, "type": "x"}).replace(b"\xa1x", b"\xa1\x80")
        got = wire.validate_request([frame])
        assert isinstance(got, Refusal) and got.reason == Reason.MALFORMED
        with pytest.raises(msgspec.DecodeError):
            wire.REPLY_DECODER.decode(frame)


@pytest.mark.parametrize("huge", [2**64 - 1, 2**63, 2**53, -(2**63), -1, True, False, 1.5])
@pytest.mark.parametrize("key", ["epoch", "step", "offset", "length", "req_id", "checksum", "v"])
def test_huge_integers(huge: int, key: str) -> None:
    for base in _MAPS:
        frame = msgspec.msgpack.encode({**base, key: huge})
        _check(frame)
        got = wire.validate_request([frame])
        if isinstance(got, Refusal):
            assert 0 <= got.req_id < 1 << 63
