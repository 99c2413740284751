"""The allreduce round of the ``"int8"`` wire format (blockwise int8, see
:mod:`chaos.collectives.compress`), with error feedback.

:class:`Int8Round` runs the same ring and tree as :class:`~chaos.collectives.algorithms.Round`,
frame by frame; only what a member does with a chunk's values differs:

* every value it sends it has just encoded: its own values (plus its residual) at its first
  send, a partial sum at an inner hop, the final value at the member that completes a chunk;
  but the last ``exact_tail`` values of the tensor travel as float32 after a chunk's int8
  payload (the part of a trainer's buffer that must stay exact: its sample count and audit
  digests);
* every value it receives it decodes to float32 and adds in float32 (``acc``), in the order the
  plain round uses, so accumulation is float32 at every hop;
* the member that completes a chunk (the ring's owner of its segment, the tree's root) divides
  for a mean, encodes, and keeps the *decoded* values as its result, exactly as every other
  member does when it decodes the frame it forwards: all members end bitwise equal.

A frame's header names the dtype ``int8`` and counts its payload in bytes (``nelem`` is
:meth:`Int8Round.chunk_bytes` of the chunk), so the payload lanes, which read ``nelem`` times
the dtype's size, carry it unchanged. Chunks hold a whole number of
blocks (the last chunk of a segment may end in a short one), as many as fit ``chunk_bytes``.
Each encoding gets a buffer of its own, which the send keeps alive, so nothing sent is
rewritten; the received frames are never written to.
"""

from __future__ import annotations

import torch

from chaos.collectives.algorithms import Round, RoundTransport
from chaos.collectives.compress import BLOCK, ErrorFeedback, decode, encode, payload_bytes
from chaos.collectives.frames import Header, Op, encode_header
from chaos.collectives.links import Frame
from chaos.collectives.topology import Topology
from chaos.errors import ProtocolError
from chaos.ops import reduce_into

__all__ = ["Int8Round", "chunk_values"]


def chunk_values(chunk_bytes: int) -> int:
    """Values per int8 chunk: the most whole blocks whose payload fits ``chunk_bytes`` (at
    least one block)."""
    return max(BLOCK, chunk_bytes * BLOCK // (BLOCK + 4) // BLOCK * BLOCK)


def _bytes(t: torch.Tensor) -> memoryview:
    return t.numpy().data


class Int8Round(Round):
    """One int8 allreduce on one member (arguments as :class:`Round`, without ``wire``).

    Args:
        comm: The communicator.
        topo: The topology.
        key: ``(epoch, step)`` of the frames.
        src: This member's values (float32, float16 or bfloat16), only read.
        acc: Flat float32 result buffer.
        op: ``"sum"`` or ``"mean"``.
        timeout_s: Progress timeout per frame.
        feedback: This member's error feedback for this tensor (``None``: none; what the
            encodings lose is dropped). The round reads its residual and writes the new one;
            the caller commits or discards it (:meth:`ErrorFeedback.commit`).
        exact_tail: The last this many values travel as float32, unrounded (a trainer's
            sample count and audit digests); the error feedback covers the others. Chunks
            shrink by three bytes a tail value so that each fits ``chunk_bytes``.

    Raises:
        ValueError: ``acc`` is not float32, or ``exact_tail`` is out of range or too long for
            a chunk (about a third of ``chunk_bytes``).
    """

    def __init__(
        self,
        comm: RoundTransport,
        topo: Topology,
        key: tuple[int, int],
        src: torch.Tensor,
        acc: torch.Tensor,
        op: str,
        timeout_s: float,
        feedback: ErrorFeedback | None,
        exact_tail: int = 0,
    ) -> None:
        if acc.dtype != torch.float32:
            raise ValueError(f"the int8 wire format accumulates in float32, not {acc.dtype}")
        # a chunk's float32 tail costs 3 more bytes a value (and up to 3 of padding): what
        # the int8 part of a chunk leaves for it keeps every payload within ``chunk_bytes``
        room = comm.config.chunk_bytes - 3 * exact_tail - 4
        if not 0 <= exact_tail <= acc.numel() or room < payload_bytes(BLOCK):
            raise ValueError(
                f"exact_tail must be in 0..{acc.numel()} and leave a block's room in a chunk "
                f"of {comm.config.chunk_bytes} bytes, not {exact_tail}"
            )
        super().__init__(comm, topo, key, src, acc, None, op, timeout_s)
        self.wire_dtype = torch.int8
        self.esize = 1
        self.chunk_elems = chunk_values(comm.config.chunk_bytes if exact_tail == 0 else room)
        self.placing = False  # payloads are decoded, never read straight into acc
        self.coded = acc.numel() - exact_tail  # [0, coded) in int8, the rest in float32
        self.feedback = feedback
        self.residual = None if feedback is None else feedback.residual(self.coded)
        if feedback is not None:
            feedback.pending(self.coded)

    def execute(self) -> None:
        """Runs the round (see :meth:`Round.execute`)."""
        if self.n == 1:
            self.acc.copy_(self.src)
            self._add_residual(0, self.acc.numel(), self.acc)
            self._finalize(0, self.acc.numel())
            return
        super().execute()

    # ------------------------------------------------------------------ the codec steps

    def _split(self, a: int, b: int) -> tuple[int, int]:
        """``(int8 values, int8 payload bytes)`` of the chunk ``[a, b)``: its values below
        :attr:`coded` are int8, the rest float32 (after the int8 part, padded to 4 bytes)."""
        q = max(0, min(b, self.coded) - a)
        return q, payload_bytes(q) if q == b - a else -(-payload_bytes(q) // 4) * 4

    def chunk_bytes(self, a: int, b: int) -> int:
        """The payload bytes of the chunk ``[a, b)``."""
        q, size = self._split(a, b)
        return size + 4 * (b - a - q)

    def _header(self, op: Op, seg: int, chunk: int, a: int, b: int) -> bytes:
        size = self.chunk_bytes(a, b)
        return encode_header(op, torch.int8, seg, self.key[0], self.key[1], chunk, size)

    def _add_residual(self, a: int, b: int, into: torch.Tensor) -> None:
        q = max(0, min(b, self.coded) - a)
        if self.residual is not None and q:
            into[:q].add_(self.residual[a : a + q])

    def _encode(self, a: int, b: int, exact: torch.Tensor, weight: float = 1.0) -> memoryview:
        """Encodes ``exact`` (the float32 values of ``[a, b)``) to send; its decoded values
        replace ``exact`` in place, and ``weight`` times what was lost is the residual."""
        q, size = self._split(a, b)
        payload = torch.empty(self.chunk_bytes(a, b), dtype=torch.uint8)
        if q < b - a:
            payload[size:].view(torch.float32).copy_(exact[q:])  # the exact tail, as is
        if q:
            coded = exact[:q]
            encode(coded, out=payload[: payload_bytes(q)])
            decoded = decode(payload[: payload_bytes(q)], q)
            if self.feedback is not None:
                error = coded - decoded
                self.feedback.wrote(a, a + q, error if weight == 1.0 else error.mul_(weight))
            coded.copy_(decoded)
        return _bytes(payload)

    def _own_bytes(self, a: int, b: int) -> memoryview:
        """This member's own values (and residual) of ``[a, b)``, encoded."""
        x = self.src[a:b].to(torch.float32, copy=True)
        self._add_residual(a, b, x)
        return self._encode(a, b, x)

    def _sum(self, frames: list[Frame], a: int, b: int) -> torch.Tensor:
        """``acc[a:b]``: this member's values and residual plus the decoded frames, in float32."""
        acc = self.acc[a:b]
        acc.copy_(self.src[a:b])
        self._add_residual(a, b, acc)
        for f in frames:
            reduce_into(acc, self._payload(f, a, b))
        return acc

    def _partial(self, frames: list[Frame], a: int, b: int) -> memoryview:
        """The partial sum of ``[a, b)`` including this member, encoded."""
        return self._encode(a, b, self._sum(frames, a, b))

    def _final(self, frames: list[Frame], a: int, b: int) -> tuple[memoryview, bool]:
        """Completes ``[a, b)``: the decoded final values in ``acc[a:b]``, and their encoding
        (in a buffer of its own, so its sends need no tracking)."""
        self._sum(frames, a, b)
        return self._finalize(a, b), False

    def _finalize(self, a: int, b: int) -> memoryview:
        """Divides ``acc[a:b]`` for a mean and rounds it through the int8 format."""
        exact = self.acc[a:b]
        mean = self.mean and self.n > 1
        if mean:
            exact.div_(self.n)
        return self._encode(a, b, exact, float(self.n) if mean else 1.0)

    def _payload(self, frame: Frame, a: int, b: int) -> torch.Tensor:
        """The decoded float32 values of a frame carrying ``[a, b)``.

        Raises:
            ProtocolError: the frame is of another format or size.
        """
        h: Header = frame.header
        total = self.chunk_bytes(a, b)
        if h.dtype != torch.int8 or h.nelem != total:
            raise ProtocolError(
                f"frame from {frame.peer!r} has {h.nelem} x {h.dtype}, expected {total} bytes "
                f"of int8 payload: members disagree on the tensor or the wire format"
            )
        buf = frame.payload.buffer
        if len(buf) != total or b == a:
            raise ProtocolError(f"frame from {frame.peer!r} has a truncated payload")
        raw = torch.frombuffer(buf, dtype=torch.uint8)
        q, size = self._split(a, b)
        out = torch.empty(b - a, dtype=torch.float32)
        if q:
            decode(raw[: payload_bytes(q)], q, out=out[:q])
        if q < b - a:
            out[q:].copy_(raw[size:].view(torch.float32))
        return out
