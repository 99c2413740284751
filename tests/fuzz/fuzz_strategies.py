"""Strategies shared by the decoder fuzz tests: random msgpack values, byte-level mutations of a
valid frame, and structural mutations (a field replaced by a wrong type, a huge integer, deep
nesting) of a valid msgpack map."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import strategies as st

HUGE_INTS = [2**64 - 1, 2**63, 2**63 - 1, 2**53, -(2**63), -1, 2**32, 2**32 - 1, 2**16]
"""Integers at the edges of the fixed widths a decoder may use."""

DEEP = 5000
"""Nesting depth of the deep-nesting cases: past msgspec's recursion limit, within 8 KiB."""


def deep_array(depth: int = DEEP) -> bytes:
    """msgpack of ``depth`` nested one-element arrays around a nil."""
    return b"\x91" * depth + b"\xc0"


def deep_map(depth: int = DEEP) -> bytes:
    """msgpack of ``depth`` nested one-entry maps (key ``"x"``) around a nil."""
    return b"\x81\xa1x" * depth + b"\xc0"


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from(HUGE_INTS),
    st.floats(),
    st.text(max_size=24),
    st.binary(max_size=48),
)
"""Every msgpack scalar, the integer range's edges included."""

values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=16,
)
"""Random msgpack structures (as Python values)."""

msgpack_values = values.map(msgspec.msgpack.encode)
"""Random msgpack structures, encoded."""


def _flip(data: bytes, i: int, bit: int) -> bytes:
    if not data:
        return data
    i %= len(data)
    return data[:i] + bytes([data[i] ^ (1 << bit)]) + data[i + 1 :]


def _truncate(data: bytes, i: int) -> bytes:
    return data[: i % (len(data) + 1)]


def _insert(data: bytes, i: int, extra: bytes) -> bytes:
    i %= len(data) + 1
    return data[:i] + extra + data[i:]


def _delete(data: bytes, i: int, n: int) -> bytes:
    i %= len(data) + 1
    return data[:i] + data[i + n :]


def _overwrite(data: bytes, i: int, extra: bytes) -> bytes:
    i %= len(data) + 1
    return data[:i] + extra + data[i + len(extra) :]


_ops = st.one_of(
    st.tuples(st.just(_flip), st.integers(0, 1 << 16), st.integers(0, 7)),
    st.tuples(st.just(_truncate), st.integers(0, 1 << 16)),
    st.tuples(st.just(_insert), st.integers(0, 1 << 16), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just(_delete), st.integers(0, 1 << 16), st.integers(1, 16)),
    st.tuples(st.just(_overwrite), st.integers(0, 1 << 16), st.binary(min_size=1, max_size=8)),
)


@st.composite
def byte_mutations(draw: st.DrawFn, valid: bytes) -> bytes:
    """``valid`` after one to four byte-level mutations (bit flip, truncation, insertion,
    deletion, overwrite)."""
    data = valid
    for op, *args in draw(st.lists(_ops, min_size=1, max_size=4)):
        data = op(data, *args)
    return data


wrong_values = st.one_of(
    values,
    st.sampled_from(HUGE_INTS),
    st.integers(-(2**63), 2**64 - 1),
    st.just([[[[[[[[[[[[[[[[[[[[0]]]]]]]]]]]]]]]]]]]]),
    st.text(min_size=1000, max_size=1100),
)
"""What a mutated field gets: anything, with the integer edges and nesting favoured."""


@st.composite
def field_mutations(draw: st.DrawFn, valid: dict[str, Any]) -> bytes:
    """``valid`` (a decoded msgpack map) with fields replaced, removed or added, re-encoded.

    Returns:
        The mutated map, encoded as msgpack.
    """
    data = dict(valid)
    keys = sorted(data) + ["type", "v", "extra"]
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(keys))
        if draw(st.booleans()) or key not in data:
            data[key] = draw(wrong_values)
        else:
            del data[key]
    return msgspec.msgpack.encode(data)


def deep_field(valid: dict[str, Any], key: str, depth: int = DEEP) -> bytes:
    """``valid`` (a decoded msgpack map) with ``key`` set to ``depth`` nested arrays, encoded by
    hand (msgspec refuses to encode what it could not decode)."""
    rest = {k: v for k, v in valid.items() if k != key}
    head = msgspec.msgpack.encode(rest)
    body = head[1:] if len(rest) < 16 else head[3:]
    n = len(rest) + 1
    prefix = bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")
    return prefix + body + msgspec.msgpack.encode(key) + deep_array(depth)
