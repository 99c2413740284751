"""Fuzzing the control plane's decoder (:mod:`chaos.protocol.codec`).

The contract: :func:`~chaos.protocol.codec.validate` never raises on bad input (it returns a
:class:`~chaos.protocol.codec.Rejected` with a reason code), and
:func:`~chaos.protocol.codec.decode` raises nothing but :class:`~chaos.errors.ProtocolError`.
"""

from __future__ import annotations

import typing
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

from chaos.bench.fuzz_frames import control_examples
from chaos.errors import ProtocolError
from chaos.protocol import codec
from chaos.protocol import messages as m

EXAMPLES: list[m.Message] = control_examples()
"""One well-formed instance of every control-plane message (the benchmark's)."""

_FRAMES = [codec.encode(msg) for msg in EXAMPLES]
_MAPS: list[dict[str, Any]] = [msgspec.msgpack.decode(f) for f in _FRAMES]

_CONTEXTS = [
    codec.ValidationContext(
        max_frame_bytes=1 << 20,
        epoch=3,
        term=2,
        members=frozenset({"n1", "n2"}),
        is_scheduler=True,
        paused=False,
        joining=False,
        node_id="n1",
    ),
    codec.ValidationContext(
        max_frame_bytes=256,
        epoch=0,
        term=0,
        members=frozenset(),
        is_scheduler=False,
        paused=True,
        joining=True,
    ),
]


def _check(frame: bytes, attachment: bytes | None = None) -> None:
    """The property: ``validate`` returns a message or a refusal, ``decode`` raises only
    ``ProtocolError``, whatever ``frame`` is."""
    for ctx in _CONTEXTS:
        got = codec.validate(frame, ctx, attachment)
        if isinstance(got, codec.Rejected):
            assert isinstance(got.refusal, m.Refusal)
            assert isinstance(got.refusal.reason, m.Reason)
        else:
            assert isinstance(got, typing.get_args(m.Message))
    try:
        codec.decode(frame, 1 << 20)
    except ProtocolError:
        pass


def test_every_message_type_has_an_example() -> None:
    assert {type(x) for x in EXAMPLES} == set(typing.get_args(m.Message))


@pytest.mark.parametrize("frame", _FRAMES, ids=[codec.tag_of(x) for x in EXAMPLES])
def test_examples_decode(frame: bytes) -> None:
    assert codec.encode(codec.decode(frame)) == frame


@settings(max_examples=300)
@given(frame=st.binary(max_size=512))
def test_random_bytes(frame: bytes) -> None:
    _check(frame)


@settings(max_examples=300)
@given(frame=msgpack_values)
def test_random_msgpack(frame: bytes) -> None:
    _check(frame)


def test_not_utf8() -> None:
    for base in _MAPS:
        _check(msgspec.msgpack.encode({**base, "type": "x"}).replace(b"\xa1x", b"\xa1\x80"))
        _check(msgspec.msgpack.encode({**base, "sender": "x"}).replace(b"\xa1x", b"\xa1\x80"))


@settings(max_examples=600)
@given(data=st.data(), i=st.integers(0, len(_FRAMES) - 1))
def test_byte_mutations_of_every_type(data: st.DataObject, i: int) -> None:
    _check(data.draw(byte_mutations(_FRAMES[i])))


@settings(max_examples=600)
@given(data=st.data(), i=st.integers(0, len(_MAPS) - 1))
def test_field_mutations_of_every_type(data: st.DataObject, i: int) -> None:
    _check(data.draw(field_mutations(_MAPS[i])))


@settings(max_examples=100)
@given(attachment=st.one_of(st.none(), st.binary(max_size=8)), i=st.integers(0, len(_FRAMES) - 1))
def test_attachments(attachment: bytes | None, i: int) -> None:
    _check(_FRAMES[i], attachment)


@pytest.mark.parametrize(
    "frame",
    [deep_array(), deep_map()],
    ids=["array", "map"],
)
def test_deep_nesting(frame: bytes) -> None:
    _check(frame)


@pytest.mark.parametrize("i", range(len(_MAPS)), ids=[codec.tag_of(x) for x in EXAMPLES])
def test_deep_nesting_in_a_field(i: int) -> None:
    """An unknown field (skipped by the schema) and a known one, nested past the recursion
    limit."""
    _check(deep_field(_MAPS[i], "extra"))
    _check(deep_field(_MAPS[i], sorted(_MAPS[i])[-1]))


@pytest.mark.parametrize("huge", [2**64 - 1, 2**63, 2**53, -(2**63)])
@pytest.mark.parametrize("key", ["epoch", "term", "seq", "size", "req_id", "v"])
def test_huge_integers(huge: int, key: str) -> None:
    for base in _MAPS:
        _check(msgspec.msgpack.encode({**base, key: huge}))
