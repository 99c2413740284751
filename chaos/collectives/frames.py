"""The data plane's frame header: a fixed, versioned binary layout (no pickle, no msgpack).

Every data frame travels as two ZeroMQ message parts: this 32-byte header, then the raw tensor
chunk (sent zero-copy). The header is a fixed C struct rather than a msgspec message because it
is parsed once per chunk on the hot path; it is validated in one place, :func:`decode_header`.

Layout (little-endian, 32 bytes)::

    u8  version   FRAME_VERSION
    u8  op        Op
    u8  dtype     wire dtype code (WIRE_DTYPES)
    u8  reserved  0
    u32 seg       ring segment index (0 for a tree)
    u64 epoch     membership epoch of the topology
    u64 step      training step of the allreduce
    u32 chunk     chunk index within the segment (ring) or the tensor (tree)
    u32 nelem     elements in the payload (bytes for the int8 format)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from chaos.errors import ProtocolError
from chaos.wire import FRAME_HEADER as _HEADER
from chaos.wire import FRAME_VERSION

HEADER_BYTES = _HEADER.size

_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1


class Op(enum.IntEnum):
    """What a frame carries."""

    RING_REDUCE_SCATTER = 1
    RING_ALLGATHER = 2
    TREE_UP = 3
    TREE_DOWN = 4
    ABORT = 5
    """The sender gave up on this (epoch, step); the payload is the failed peer's id (utf-8)."""
    NEWER = 6
    """The sender runs this step under the header's newer epoch (it got an older-epoch frame
    from the receiver): the receiver's round cannot complete. Empty payload."""
    BEHIND = 7
    """The sender still runs the header's step, which the receiver (a step ahead) completed:
    it asks for that round's result. Empty payload."""
    RESULT = 8
    """The result of the header's step, which the sender completed and the receiver did not
    (a member died while the result was going out): ``nelem`` elements of the header's dtype."""
    LANE = 9
    """The sender offers a payload lane (see :mod:`chaos.collectives.lanes`): the payload is
    its lane port and a token; the receiver connects and sends its data frames there."""


DATA_OPS = frozenset({Op.RING_REDUCE_SCATTER, Op.RING_ALLGATHER, Op.TREE_UP, Op.TREE_DOWN})
"""The ops whose frames carry tensor chunks; only these travel on lanes."""


WIRE_DTYPES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.int8: 5,
}
"""The wire dtype codes. ``int8`` is the blockwise format of :mod:`chaos.collectives.compress`:
its frames' ``nelem`` counts payload bytes (the block scales, then one code per value)."""
_CODE_DTYPES = {code: dt for dt, code in WIRE_DTYPES.items()}


@dataclass(frozen=True, slots=True)
class Header:
    """A decoded frame header (see the module docstring for the layout)."""

    op: Op
    dtype: torch.dtype
    seg: int
    epoch: int
    step: int
    chunk: int
    nelem: int

    @property
    def key(self) -> tuple[int, int]:
        """``(epoch, step)``: frames of different keys never mix."""
        return (self.epoch, self.step)


def encode_header(
    op: Op, dtype: torch.dtype, seg: int, epoch: int, step: int, chunk: int, nelem: int
) -> bytes:
    """Packs a header.

    Raises:
        ValueError: a field does not fit its width, or the dtype has no wire code.
    """
    code = WIRE_DTYPES.get(dtype)
    if code is None:
        raise ValueError(f"no wire format for dtype {dtype}")
    if not (0 <= seg <= _U32 and 0 <= chunk <= _U32 and 0 <= nelem <= _U32):
        raise ValueError("seg, chunk and nelem must fit in 32 bits")
    if not (0 <= epoch <= _U64 and 0 <= step <= _U64):
        raise ValueError("epoch and step must fit in 64 bits")
    return _HEADER.pack(FRAME_VERSION, int(op), code, 0, seg, epoch, step, chunk, nelem)


def decode_header(raw: bytes | memoryview) -> Header:
    """Unpacks and validates a header.

    Raises:
        ProtocolError: wrong length, wrong version, unknown op or dtype code.
    """
    if len(raw) != HEADER_BYTES:
        raise ProtocolError(f"frame header is {len(raw)} bytes, expected {HEADER_BYTES}")
    version, op, code, _reserved, seg, epoch, step, chunk, nelem = _HEADER.unpack(raw)
    if version != FRAME_VERSION:
        raise ProtocolError(f"frame version {version}, expected {FRAME_VERSION}")
    try:
        op_e = Op(op)
    except ValueError:
        raise ProtocolError(f"unknown frame op {op}") from None
    dtype = _CODE_DTYPES.get(code)
    if dtype is None:
        raise ProtocolError(f"unknown wire dtype code {code}")
    return Header(op_e, dtype, seg, epoch, step, chunk, nelem)
