"""Payload lanes (chaos.collectives.lanes): chunks over plain TCP beside ZeroMQ.

Real communicators on loopback, one thread each (the multi-process fault tests in
test_collectives.py run with lanes on too, since that is the default).
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from chaos.collectives import Communicator, CommunicatorConfig, Topology
from chaos.collectives.frames import HEADER_BYTES, Op, encode_header
from chaos.collectives.lanes import decode_offer, encode_hello, encode_offer
from chaos.errors import PeerFailure, ProtocolError, RoundInterrupted

NUMEL = 50_000
CHUNK = 1 << 14  # 16 KiB: a dozen chunks per member


@contextmanager
def members(n: int, **config: Any) -> Iterator[list[Communicator]]:
    # lane_min_bytes=0: these small tensors take the lanes too
    settings: dict[str, Any] = {"chunk_bytes": CHUNK, "timeout_s": 10.0, "lane_min_bytes": 0,
                                **config}  # fmt: skip
    comms = [Communicator(CommunicatorConfig(node_id=f"m{i}", **settings)) for i in range(n)]
    try:
        yield comms
    finally:
        for c in comms:
            c.close()


def install(comms: list[Communicator], kind: str, epoch: int) -> None:
    names = tuple(c.node_id for c in comms)
    addrs = {c.node_id: c.address for c in comms}
    if kind == "ring":
        topo = Topology("ring", names, addrs, epoch, ring_order=names)
    else:
        parent = {m: (None if i == 0 else names[(i - 1) // 2]) for i, m in enumerate(names)}
        topo = Topology("tree", names, addrs, epoch, parent=parent)
    for c in comms:
        c.update_topology(topo)


def inputs(n: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)).to(dtype)
            for i in range(n)]  # fmt: skip


def run_all(comms: list[Communicator], xs: list[torch.Tensor], **kw: Any) -> list[Any]:
    """One allreduce on every member at once; each entry is the result or the exception."""
    out: list[Any] = [None] * len(comms)

    def one(i: int) -> None:
        try:
            out[i] = comms[i].allreduce(xs[i], **kw)
        except Exception as exc:  # collected and checked by the test
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


def results(comms: list[Communicator], xs: list[torch.Tensor], **kw: Any) -> list[torch.Tensor]:
    out = run_all(comms, xs, **kw)
    for r in out:
        if not isinstance(r, torch.Tensor):
            raise AssertionError(f"an allreduce failed: {out}")
    return out


@pytest.mark.parametrize("kind", ["ring", "tree"])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_lanes_carry_the_chunks_and_match_zeromq_bitwise(kind: str, op: str) -> None:
    xs = inputs(4)
    with members(4) as fast, members(4, lanes=False) as plain:
        install(fast, kind, 1)
        install(plain, kind, 1)
        for _ in range(3):  # the first round sets the lanes up; later ones use them
            a = results(fast, xs, op=op)
            b = results(plain, xs, op=op)
            for r in a + b:  # same algorithm, same sums: bitwise equal whatever the transport
                assert torch.equal(r.view(torch.int32), a[0].view(torch.int32))
        ref = torch.stack([x.double() for x in xs]).sum(0)
        ref = ref / 4 if op == "mean" else ref
        torch.testing.assert_close(a[0].double(), ref, atol=1e-4, rtol=1e-5)
        for x, i in zip(xs, range(4), strict=True):
            assert torch.equal(x, inputs(4)[i])  # inputs untouched
        assert all(c.stats.lane_frames_received > 0 for c in fast)
        assert sum(c.stats.lane_frames_placed for c in fast) > 0  # read straight into the result
        assert all(c.stats.lane_frames_sent == 0 for c in plain)
        assert all(c.stats.lane_frames_received == 0 for c in plain)


def test_half_precision_inputs_and_a_wire_format_take_the_copying_path() -> None:
    xs = inputs(3, torch.float16)
    with members(3) as comms:
        install(comms, "ring", 1)
        for _ in range(2):
            out = results(comms, xs, op="sum", wire_dtype="bfloat16")
            assert all(torch.equal(r, out[0]) for r in out)
        assert sum(c.stats.lane_frames_received for c in comms) > 0
        assert sum(c.stats.lane_frames_placed for c in comms) == 0  # not the result's dtype


def test_tensors_below_lane_min_bytes_go_through_zeromq_without_setting_lanes_up() -> None:
    xs = inputs(3)  # 200 KB
    with members(3, lane_min_bytes=NUMEL * 4 + 1) as comms:
        install(comms, "ring", 1)
        for _ in range(3):
            out = results(comms, xs, op="sum")
            assert all(torch.equal(r, out[0]) for r in out)
        for c in comms:
            assert c.stats.lane_frames_sent == c.stats.lane_frames_received == 0
            assert c._lanes.lanes is None  # not even a listener
        big = [torch.cat([x] * 2) for x in xs]  # now at the threshold: lanes from here on
        for _ in range(2):
            out = results(comms, big, op="sum")
        assert sum(c.stats.lane_frames_received for c in comms) > 0


def test_no_lanes_on_an_ipc_endpoint(tmp_path: Any) -> None:
    comm = Communicator(
        CommunicatorConfig("solo", listen=f"ipc://{tmp_path}/d.sock", lane_min_bytes=0)
    )
    try:
        comm.update_topology(Topology("ring", ("solo",), {"solo": comm.address}, 1,
                                      ring_order=("solo",)))  # fmt: skip
        assert torch.equal(comm.allreduce(torch.ones(8), "sum"), torch.ones(8))
        assert comm._lanes.lanes is None
    finally:
        comm.close()


def _lane_port(comm: Communicator) -> int:
    lanes = comm._lanes.lanes
    if lanes is None:
        raise AssertionError("lanes are off")
    return lanes.port


@pytest.mark.parametrize(
    "hello",
    [
        b"GET / HTTP/1.0\r\n\r\n",  # not a hello
        encode_hello("m1", 12345),  # a neighbour's id with a token never offered
        encode_hello("stranger", 1),  # an unknown peer
        b"",  # connects and says nothing, then closes
    ],
)
def test_a_bad_hello_is_refused_and_the_node_keeps_working(hello: bytes) -> None:
    xs = inputs(3)
    with members(3) as comms:
        install(comms, "ring", 1)
        lanes = None
        for _ in range(20):  # rounds until m0's lane from its left neighbour is up
            results(comms, xs, op="sum")
            lanes = comms[0]._lanes.lanes
            if lanes is not None and "m2" in lanes.incoming:
                break
        assert lanes is not None and "m2" in lanes.incoming
        before = dict(lanes.incoming)
        with socket.create_connection(("127.0.0.1", _lane_port(comms[0])), timeout=5) as s:
            s.sendall(hello)
            if not hello:
                s.shutdown(socket.SHUT_WR)
            out = results(comms, xs, op="sum")  # the node polls its listener while it runs
            out = results(comms, xs, op="sum")
        assert all(torch.equal(r, out[0]) for r in out)
        assert lanes.rejected >= 1
        assert lanes.incoming == before  # the real lanes were not replaced


@pytest.mark.parametrize(
    "garbage",
    [
        b"\xff" * HEADER_BYTES,  # bad version
        encode_header(Op.ABORT, torch.float32, 0, 1, 0, 0, 0),  # not a data op
        encode_header(Op.RING_ALLGATHER, torch.float32, 0, 1, 99, 0, CHUNK),  # over chunk_bytes
    ],
)
def test_a_malformed_frame_on_a_lane_closes_it_and_the_next_round_recovers(garbage: bytes) -> None:
    xs = inputs(3)
    with members(3, timeout_s=3.0) as comms:
        install(comms, "ring", 1)
        results(comms, xs, op="sum")
        sender = comms[2]._lanes.lanes
        for _ in range(20):  # rounds until m2's lane to m0 (its right neighbour) is up
            if sender is not None and "m0" in sender.outgoing and sender.outgoing["m0"].ready:
                break
            results(comms, xs, op="sum")
            sender = comms[2]._lanes.lanes
        assert sender is not None
        out_lane = sender.outgoing["m0"]
        sock = out_lane._sock
        assert sock is not None and out_lane.ready
        sock.sendall(garbage)
        first = run_all(comms, xs, op="sum")  # frames after the garbage are lost with the lane
        receiver = comms[0]
        assert receiver.stats.dropped_malformed >= 1
        lanes = receiver._lanes.lanes
        assert "m2" not in (lanes.incoming if lanes else {}) or all(
            isinstance(r, torch.Tensor) for r in first
        )
        if not all(isinstance(r, torch.Tensor) for r in first):
            assert all(isinstance(r, (PeerFailure, torch.Tensor)) for r in first), first
            install(comms, "ring", 2)  # rerun the step under a new epoch
        received = receiver.stats.lane_frames_received
        for _ in range(20):  # the new lane connects in its own thread: rounds until it is used
            out = results(comms, xs, op="sum")
            assert all(torch.equal(r, out[0]) for r in out)
            if receiver.stats.lane_frames_received > received:
                break
        assert receiver.stats.lane_frames_received > received  # a new lane was offered and used


def test_offer_and_hello_encoding() -> None:
    assert decode_offer(encode_offer(4242, 7)) == (4242, 7)
    with pytest.raises(ProtocolError, match="bytes"):
        decode_offer(b"\x01\x02")
    with pytest.raises(ProtocolError, match="port 0"):
        decode_offer(struct.pack("<HQ", 0, 7))
    with pytest.raises(ValueError):
        encode_hello("", 1)
    with pytest.raises(ValueError):
        encode_hello("x" * 256, 1)


def test_a_closed_communicator_closes_its_lanes() -> None:
    xs = inputs(2)
    with members(2) as comms:
        install(comms, "ring", 1)
        results(comms, xs, op="sum")
        results(comms, xs, op="sum")
        port = _lane_port(comms[0])
        comms[0].close()
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_a_frame_stalled_halfway_still_sees_an_interrupt_between_read_slices() -> None:
    xs = inputs(2)
    with members(2, poll_slice_s=0.05, timeout_s=30.0) as comms:
        install(comms, "ring", 1)
        sender = comms[1]._lanes.lanes
        for _ in range(20):  # rounds until m1's lane to m0 is up
            if sender is not None and "m0" in sender.outgoing and sender.outgoing["m0"].ready:
                break
            results(comms, xs, op="sum")
            sender = comms[1]._lanes.lanes
        assert sender is not None
        sock = sender.outgoing["m0"]._sock
        assert sock is not None
        # a well-formed header of an old round, then half of its payload, then nothing
        sock.sendall(encode_header(Op.RING_REDUCE_SCATTER, torch.float32, 0, 1, 0, 0, 64))
        sock.sendall(b"\0" * 128)
        calls = []

        def interrupt() -> str | None:  # the first check passes; any later one interrupts
            calls.append(1)
            return "stop" if len(calls) > 1 else None

        comms[0].set_interrupt(interrupt, every_s=1e-6)
        with pytest.raises(RoundInterrupted):
            comms[0].allreduce(xs[0], "sum")  # m1 never runs this round
        lanes = comms[0]._lanes.lanes
        assert lanes is not None and "m1" not in lanes.incoming  # the cut stream is closed
