"""Fuzzing the allreduce frame header (:func:`chaos.collectives.frames.decode_header`).

The contract: a :class:`~chaos.collectives.frames.Header` or a
:class:`~chaos.errors.ProtocolError`, for any bytes.
"""

from __future__ import annotations

import pytest
import torch
from fuzz_strategies import byte_mutations
from hypothesis import given, settings
from hypothesis import strategies as st

from chaos.collectives.frames import (
    HEADER_BYTES,
    WIRE_DTYPES,
    Header,
    Op,
    decode_header,
    encode_header,
)
from chaos.errors import ProtocolError
from chaos.wire import FRAME_HEADER, FRAME_VERSION

_VALID = [
    encode_header(op, dt, 1, 2**64 - 1, 7, 2**32 - 1, 1024) for op in Op for dt in WIRE_DTYPES
]


def check_header(raw: bytes) -> Header | None:
    """The property; returns the header when ``raw`` is one."""
    try:
        header = decode_header(raw)
    except ProtocolError:
        return None
    assert len(raw) == HEADER_BYTES
    assert isinstance(header.op, Op) and header.dtype in WIRE_DTYPES
    return header


@settings(max_examples=400)
@given(raw=st.binary(max_size=64))
def test_random_bytes(raw: bytes) -> None:
    check_header(raw)


@settings(max_examples=400)
@given(raw=st.binary(min_size=HEADER_BYTES, max_size=HEADER_BYTES))
def test_random_headers(raw: bytes) -> None:
    check_header(raw)


@settings(max_examples=400)
@given(data=st.data(), i=st.integers(0, len(_VALID) - 1))
def test_mutations(data: st.DataObject, i: int) -> None:
    check_header(data.draw(byte_mutations(_VALID[i])))


@settings(max_examples=300)
@given(
    version=st.integers(0, 255),
    op=st.integers(0, 255),
    code=st.integers(0, 255),
    reserved=st.integers(0, 255),
    seg=st.integers(0, 2**32 - 1),
    epoch=st.integers(0, 2**64 - 1),
    step=st.integers(0, 2**64 - 1),
    chunk=st.integers(0, 2**32 - 1),
    nelem=st.integers(0, 2**32 - 1),
)
def test_every_field(
    version: int,
    op: int,
    code: int,
    reserved: int,
    seg: int,
    epoch: int,
    step: int,
    chunk: int,
    nelem: int,
) -> None:
    raw = FRAME_HEADER.pack(version, op, code, reserved, seg, epoch, step, chunk, nelem)
    header = check_header(raw)
    valid = version == FRAME_VERSION and op in set(Op) and code in WIRE_DTYPES.values()
    assert (header is not None) == valid
    if header is not None:
        assert (header.seg, header.epoch, header.step, header.chunk, header.nelem) == (
            seg,
            epoch,
            step,
            chunk,
            nelem,
        )


@pytest.mark.parametrize("raw", _VALID[:3])
def test_memoryview_and_bytearray(raw: bytes) -> None:
    assert decode_header(memoryview(raw)) == decode_header(bytearray(raw)) == decode_header(raw)


def test_encode_refuses_what_does_not_fit() -> None:
    with pytest.raises(ValueError):
        encode_header(Op.TREE_UP, torch.float32, 0, 2**64, 0, 0, 0)
    with pytest.raises(ValueError):
        encode_header(Op.TREE_UP, torch.complex64, 0, 0, 0, 0, 0)  # no wire code
