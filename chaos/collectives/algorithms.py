"""The allreduce algorithms: chunked ring and pipelined tree, driven frame by frame.

Both run event-driven on the frames that arrive, so computing (reducing a chunk) overlaps with
ZeroMQ's I/O thread moving the next chunks:

* **Ring** over ``n`` members (reduce-scatter then allgather). The tensor is cut into ``n``
  segments, each into chunks. Member ``i`` sends its segment ``i`` to the right; a received
  reduce-scatter chunk of segment ``s`` is reduced into the accumulator and forwarded at once,
  until it has passed ``n - 1`` members; the last one finalizes it (divides for a mean, rounds to
  the wire format) and starts it around the ring as an allgather chunk, which every member copies
  and forwards unchanged (the received ZeroMQ frame itself, no copy).
* **Tree** (pipelined reduce then broadcast). Leaves send all their chunks up; an inner node
  forwards chunk ``j`` up as soon as every child's chunk ``j`` is reduced into it; the root
  finalizes chunk ``j`` and sends it down while later chunks are still coming up; inner nodes copy
  and forward the down chunks unchanged.

Only one member computes each final value and everyone else copies it, so all members end
bitwise equal. Sends are zero-copy; a buffer region is rewritten only after a causally later
frame proves the neighbour received it, and the final regions sent from this node's own result
buffer are tracked and waited for before the result is handed back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import zmq

from chaos.collectives.config import CommunicatorConfig
from chaos.collectives.frames import Header, Op, encode_header
from chaos.collectives.links import Frame, LanePayload
from chaos.collectives.topology import Topology
from chaos.errors import PeerTimeout, ProtocolError
from chaos.ops import reduce_into

__all__ = ["Round", "RoundTransport", "chunk_elems", "chunks", "split"]


class RoundTransport(Protocol):
    """What a :class:`Round` needs of its communicator (a
    :class:`~chaos.collectives.communicator.Communicator` is one): its id and settings, and the
    sending and receiving of data frames."""

    @property
    def node_id(self) -> str:
        """This member's id."""
        ...

    @property
    def config(self) -> CommunicatorConfig:
        """The settings (the round reads ``chunk_bytes``)."""
        ...

    def send(
        self,
        peer: str,
        header: bytes | zmq.Frame,
        payload: zmq.Frame | memoryview | LanePayload,
        *,
        track: bool = False,
    ) -> zmq.MessageTracker | None:
        """Sends one data frame to a neighbour (a tracker when ``track`` is honoured)."""
        ...

    def recv(
        self,
        key: tuple[int, int],
        timeout_s: float,
        waiting_for: str | Callable[[], str],
        place: Callable[[str, Header], memoryview | None] | None = None,
    ) -> Frame:
        """The next frame of round ``key`` from a neighbour (``place`` names where a lane
        payload is read to)."""
        ...

    def drain_lanes(self, timeout_s: float) -> None:
        """Waits until the frames queued on payload lanes are written."""
        ...


def split(start: int, stop: int, parts: int) -> list[tuple[int, int]]:
    """Cuts ``[start, stop)`` into ``parts`` contiguous ranges whose sizes differ by at most 1."""
    n = stop - start
    base, extra = divmod(n, parts)
    out = []
    a = start
    for k in range(parts):
        b = a + base + (1 if k < extra else 0)
        out.append((a, b))
        a = b
    return out


def chunks(start: int, stop: int, chunk_elems: int) -> list[tuple[int, int]]:
    """Cuts ``[start, stop)`` into ranges of ``chunk_elems`` (the last may be shorter)."""
    return [(a, min(a + chunk_elems, stop)) for a in range(start, stop, chunk_elems)]


def chunk_elems(config: CommunicatorConfig, numel: int, esize: int) -> int:
    """Elements per chunk of a round of ``numel`` elements of ``esize`` bytes: at most
    ``config.chunk_bytes``, and few enough for ``config.min_chunks`` chunks, but not fewer
    than ``config.min_chunk_bytes`` (see :class:`CommunicatorConfig`). It depends only on the
    settings and the tensor, so every member cuts the same chunks."""
    floor = min(config.chunk_bytes, config.min_chunk_bytes)
    want = -(-numel * esize // config.min_chunks)  # ceil
    return max(1, max(floor, min(config.chunk_bytes, want)) // esize)


def _bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous 1-D tensor (works for bfloat16 too)."""
    return t.view(torch.uint8).numpy().data


class Round:
    """One allreduce on one member.

    Args:
        comm: The communicator (sending and the receive loop).
        topo: The topology it runs on.
        key: ``(epoch, step)`` of the frames.
        src: This member's values, flat and contiguous; only read (and sent zero-copy when it is
            already in the wire dtype).
        acc: Flat float32/float64 result buffer. Each chunk is initialized from ``src`` just
            before its first reduction (while it is hot in cache), so no up-front copy is made.
        wire: Flat buffer in the wire dtype, or ``None`` when the wire dtype is ``acc``'s.
        op: ``"sum"`` or ``"mean"``.
        timeout_s: Progress timeout per frame.
    """

    def __init__(
        self,
        comm: RoundTransport,
        topo: Topology,
        key: tuple[int, int],
        src: torch.Tensor,
        acc: torch.Tensor,
        wire: torch.Tensor | None,
        op: str,
        timeout_s: float,
    ) -> None:
        self.comm = comm
        self.me = comm.node_id
        self.topo = topo
        self.key = key
        self.src = src
        self.acc = acc
        self.wire = wire
        self.wire_dtype = acc.dtype if wire is None else wire.dtype
        self.n = len(topo.members)
        self.mean = op == "mean"
        self.timeout_s = timeout_s
        self.esize = self.wire_dtype.itemsize
        # a tree of more than two fills and drains its pipeline a chunk per level: a tensor of
        # a few chunk sizes is cut finer (a ring keeps every link busy at any chunk size)
        deep = topo.kind == "tree" and self.n > 2
        self.chunk_elems = (chunk_elems(comm.config, acc.numel(), self.esize) if deep
                            else max(1, comm.config.chunk_bytes // self.esize))  # fmt: skip
        self.trackers: list[tuple[str, zmq.MessageTracker]] = []
        # payloads arriving on lanes are read straight into ``acc`` (no copy) when the wire
        # format is the accumulation dtype and the input's (see Communicator.recv's ``place``)
        self.placing = wire is None and src.dtype == self.wire_dtype

    def execute(self) -> None:
        """Runs the algorithm of the topology's kind.

        Raises:
            PeerFailure, PeerTimeout, ProtocolError: as :meth:`Communicator.allreduce`.
        """
        if self.n == 1:
            self.acc.copy_(self.src)
            self._finalize(0, self.acc.numel())
            return
        if self.topo.kind == "ring":
            order = self.topo.ring_order
            if order is None:  # pragma: no cover - guaranteed by Topology
                raise ValueError("ring topology without an order")
            self._ring(order)
        elif self.n == 2:
            # a tree of two is one full-duplex link: run it as a ring of two (each member
            # reduces half and sends it back), which keeps both directions busy from the first
            # byte to the last; a root has nothing to send until the first chunk is up
            root = self.topo.root
            if root is None:  # pragma: no cover - guaranteed by Topology
                raise ValueError("tree topology without a root")
            self._ring((root, *self.topo.children(root)))
        else:
            self._tree()
        for peer, tracker in self.trackers:
            try:
                tracker.wait(self.timeout_s)
            except zmq.NotDone:
                raise PeerTimeout(peer, "final frames not taken", reported_by=self.me) from None
        self.comm.drain_lanes(self.timeout_s)

    # ------------------------------------------------------------------ shared steps

    def _header(self, op: Op, seg: int, chunk: int, a: int, b: int) -> bytes:
        return encode_header(op, self.wire_dtype, seg, self.key[0], self.key[1], chunk, b - a)

    def _own_bytes(self, a: int, b: int) -> memoryview:
        """This member's own values ``src[a:b]`` in the wire format, zero-copy when possible.

        A conversion is staged in ``wire`` (or in ``acc``, whose region is overwritten only by
        the final values, which arrive causally after the neighbour has received these bytes).
        """
        if self.src.dtype == self.wire_dtype:
            return _bytes(self.src[a:b])
        stage = self.acc if self.wire is None else self.wire
        stage[a:b].copy_(self.src[a:b])
        return _bytes(stage[a:b])

    def _to_wire(self, a: int, b: int) -> memoryview:
        """The partial sums ``acc[a:b]`` in the wire format."""
        if self.wire is None:
            return _bytes(self.acc[a:b])
        self.wire[a:b].copy_(self.acc[a:b])
        return _bytes(self.wire[a:b])

    def _combine(self, frames: list[Frame], a: int, b: int) -> zmq.Frame | LanePayload | None:
        """Adds this member's values ``src[a:b]`` to the partial sums carried by ``frames``.

        When the wire format is the accumulation dtype, the sum is built in place in the first
        received frame (its memory is ours, and forwarding it is zero-copy), and that frame is
        returned. Otherwise the sum is built in ``acc[a:b]`` and ``None`` is returned.
        """
        if self.wire is None and self.src.dtype == self.wire_dtype:
            head = self._payload(frames[0], a, b)
            reduce_into(head, self.src[a:b])
            for f in frames[1:]:
                reduce_into(head, self._payload(f, a, b))
            return frames[0].payload
        acc = self.acc[a:b]
        acc.copy_(self.src[a:b])
        for f in frames:
            reduce_into(acc, self._payload(f, a, b))
        return None

    def _partial(
        self, frames: list[Frame], a: int, b: int
    ) -> zmq.Frame | LanePayload | memoryview:
        """The partial sum of ``[a, b)`` including this member, ready to send on."""
        combined = self._combine(frames, a, b)
        return self._to_wire(a, b) if combined is None else combined

    def _final(
        self, frames: list[Frame], a: int, b: int
    ) -> tuple[zmq.Frame | LanePayload | memoryview, bool]:
        """Completes ``[a, b)``: the final values are in ``acc[a:b]`` and returned to send.

        Returns:
            ``(data, from_buffer)``: ``from_buffer`` says the data lies in one of this round's
            buffers (its sends must be tracked), rather than in a received frame.
        """
        combined = self._combine(frames, a, b)
        if combined is None:
            return self._finalize(a, b), True
        if self.mean:
            torch.frombuffer(combined.buffer, dtype=self.wire_dtype).div_(self.n)
        if not frames[0].placed:  # a placed frame's payload already is acc[a:b]
            self.acc[a:b].copy_(torch.frombuffer(combined.buffer, dtype=self.wire_dtype))
        return combined, False

    def _finalize(self, a: int, b: int) -> memoryview:
        """Makes ``acc[a:b]`` final (mean division, rounding through the wire format).

        Returns:
            The final values in the wire format, to send.
        """
        if self.mean and self.n > 1:
            self.acc[a:b].div_(self.n)
        if self.wire is None:
            return _bytes(self.acc[a:b])
        self.wire[a:b].copy_(self.acc[a:b])
        self.acc[a:b].copy_(self.wire[a:b])
        return _bytes(self.wire[a:b])

    def _payload(self, frame: Frame, a: int, b: int) -> torch.Tensor:
        h = frame.header
        if h.dtype != self.wire_dtype or h.nelem != b - a:
            raise ProtocolError(
                f"frame from {frame.peer!r} has {h.nelem} x {h.dtype}, expected {b - a} x "
                f"{self.wire_dtype}: members disagree on the tensor or the wire format"
            )
        buf = frame.payload.buffer
        if len(buf) != (b - a) * self.esize or b == a:
            raise ProtocolError(f"frame from {frame.peer!r} has a truncated payload")
        return torch.frombuffer(buf, dtype=self.wire_dtype)

    def _region(
        self, table: list[list[tuple[int, int]]], h: Header, seen: set[tuple[int, int, int]]
    ) -> memoryview | None:
        """``acc``'s bytes for the chunk ``h`` names, to read a lane payload into; ``None``
        (read it elsewhere, and let the algorithm refuse it) for a chunk already received, out
        of range, or of the wrong size or dtype."""
        if not self.placing or h.dtype != self.wire_dtype or (h.op, h.seg, h.chunk) in seen:
            return None
        if h.seg >= len(table) or h.chunk >= len(table[h.seg]):
            return None
        a, b = table[h.seg][h.chunk]
        return _bytes(self.acc[a:b]) if h.nelem == b - a and b > a else None

    def _lookup(self, table: list[list[tuple[int, int]]], frame: Frame) -> tuple[int, int]:
        h = frame.header
        if h.seg >= len(table) or h.chunk >= len(table[h.seg]):
            raise ProtocolError(f"frame from {frame.peer!r} names chunk {h.seg}/{h.chunk}")
        return table[h.seg][h.chunk]

    # ------------------------------------------------------------------ ring

    def _ring(self, order: tuple[str, ...]) -> None:
        """The ring over ``order`` (every member once; a member sends to the next)."""
        n = self.n
        i = order.index(self.me)
        left, right = order[(i - 1) % n], order[(i + 1) % n]
        segs = [chunks(a, b, self.chunk_elems) for a, b in split(0, self.acc.numel(), n)]
        for j, (a, b) in enumerate(segs[i]):
            self.comm.send(right, self._header(Op.RING_REDUCE_SCATTER, i, j, a, b),
                           self._own_bytes(a, b))  # fmt: skip
        owned = (i + 1) % n
        expected = sum(len(c) for c in segs) * 2 - len(segs[i]) - len(segs[owned])
        seen: set[tuple[int, int, int]] = set()

        def place(peer: str, h: Header) -> memoryview | None:
            ok = (h.op == Op.RING_REDUCE_SCATTER and h.seg != i) or (
                h.op == Op.RING_ALLGATHER and h.seg != owned
            )
            return self._region(segs, h, seen) if ok and peer == left else None

        while len(seen) < expected:
            frame = self.comm.recv(self.key, self.timeout_s, left, place)
            h = frame.header
            if frame.peer != left or (h.op, h.seg, h.chunk) in seen:
                raise ProtocolError(f"unexpected ring frame {h} from {frame.peer!r}")
            seen.add((h.op, h.seg, h.chunk))
            a, b = self._lookup(segs, frame)
            if h.op == Op.RING_REDUCE_SCATTER and h.seg != i:
                final = h.seg == owned
                track = final and h.chunk == len(segs[owned]) - 1
                self._ring_reduce(frame, a, b, final=final, track=track, right=right)
            elif h.op == Op.RING_ALLGATHER and h.seg != owned:
                values = self._payload(frame, a, b)
                if not frame.placed:
                    self.acc[a:b].copy_(values)
                if (i - h.seg) % n < n - 2:  # not yet back at the member before the owner
                    self.comm.send(right, frame.raw_header, frame.payload)
            else:
                raise ProtocolError(f"unexpected ring frame {h} from {frame.peer!r}")

    def _ring_reduce(
        self, frame: Frame, a: int, b: int, *, final: bool, track: bool, right: str
    ) -> None:
        if not final:
            self.comm.send(right, frame.raw_header, self._partial([frame], a, b))
            return
        h = frame.header
        data, from_buffer = self._final([frame], a, b)
        tracker = self.comm.send(right, self._header(Op.RING_ALLGATHER, h.seg, h.chunk, a, b),
                                 data, track=track and from_buffer)  # fmt: skip
        if tracker is not None:
            self.trackers.append((right, tracker))

    # ------------------------------------------------------------------ tree

    def _tree(self) -> None:
        parent_map = self.topo.parent
        if parent_map is None:  # pragma: no cover - guaranteed by Topology
            raise ValueError("tree topology without parents")
        parent = parent_map[self.me]
        children = self.topo.children(self.me)
        table = [chunks(0, self.acc.numel(), self.chunk_elems)]
        pending: list[list[Frame]] = [[] for _ in table[0]]
        if not children and parent is not None:  # a leaf sends its own values
            for j, (a, b) in enumerate(table[0]):
                self.comm.send(parent, self._header(Op.TREE_UP, 0, j, a, b), self._own_bytes(a, b))
        expected = len(table[0]) * (len(children) + (parent is not None))
        seen: set[tuple[str, int, int]] = set()

        def blame() -> str:
            for j, got in enumerate(pending):
                missing = [c for c in children if (c, Op.TREE_UP, j) not in seen]
                if missing and len(got) < len(children):
                    return missing[0]
            return parent if parent is not None else children[0]

        down_seen: set[tuple[int, int, int]] = set()

        def place(peer: str, h: Header) -> memoryview | None:
            ok = h.op == Op.TREE_DOWN and peer == parent and h.seg == 0
            return self._region(table, h, down_seen) if ok else None

        while len(seen) < expected:
            frame = self.comm.recv(self.key, self.timeout_s, blame, place)
            h = frame.header
            tag = (frame.peer, int(h.op), h.chunk)
            up = h.op == Op.TREE_UP and frame.peer in children
            down = h.op == Op.TREE_DOWN and frame.peer == parent
            if tag in seen or h.seg != 0 or not (up or down):
                raise ProtocolError(f"unexpected tree frame {h} from {frame.peer!r}")
            seen.add(tag)
            if down:
                down_seen.add((int(h.op), h.seg, h.chunk))
            a, b = self._lookup(table, frame)
            if up:
                pending[h.chunk].append(frame)
                if len(pending[h.chunk]) == len(children):
                    frames = sorted(pending[h.chunk], key=lambda f: f.peer)  # fixed sum order
                    pending[h.chunk] = []
                    self._tree_chunk_done(h.chunk, table, frames, parent, children)
            else:
                values = self._payload(frame, a, b)
                if not frame.placed:
                    self.acc[a:b].copy_(values)
                for c in children:
                    self.comm.send(c, frame.raw_header, frame.payload)

    def _tree_chunk_done(
        self, j: int, table: list[list[tuple[int, int]]], frames: list[Frame],
        parent: str | None, children: tuple[str, ...],
    ) -> None:  # fmt: skip
        """All children's chunk ``j`` arrived: send the subtree's sum up, or (root) broadcast."""
        a, b = table[0][j]
        if parent is not None:
            self.comm.send(parent, frames[0].raw_header, self._partial(frames, a, b))
            return
        data, from_buffer = self._final(frames, a, b)
        header = self._header(Op.TREE_DOWN, 0, j, a, b)
        last = j == len(table[0]) - 1
        for c in children:
            tracker = self.comm.send(c, header, data, track=last and from_buffer)
            if tracker is not None:
                self.trackers.append((c, tracker))
