"""The allreduce with a cluster key: CURVE links, sealed payload lanes, members bound to keys.

Real communicators on loopback, one thread each. A stranger is a socket of this test: a plain
ZeroMQ DEALER, one with another cluster's key, a raw TCP connection to a lane listener, or a key
holder that claims another member's routing id.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import zmq

from chaos.collectives import Communicator, CommunicatorConfig, Topology
from chaos.collectives.frames import Op, encode_header
from chaos.collectives.lanes import (
    LANE_KEY_BYTES,
    LaneCipher,
    Lanes,
    decode_sealed_offer,
    encode_hello,
    encode_sealed_hello,
    encode_sealed_offer,
)
from chaos.collectives.links import member_of, routing_id
from chaos.errors import PeerFailure, ProtocolError
from chaos.security import ClusterKey, Security
from chaos.wire import LANE_RECORD_BYTES
from tests.collectives.test_lanes import results as _results
from tests.collectives.test_lanes import run_all

NUMEL = 50_000
CHUNK = 1 << 14  # 16 KiB: a dozen chunks per member
ROUNDS = 20  # rounds a test may run until a lane is up, or a stranger's frame was read


@contextmanager
def members(n: int, key: ClusterKey | None, **config: Any) -> Iterator[list[Communicator]]:
    # lane_min_bytes=0: these small tensors take the lanes too
    settings: dict[str, Any] = {"chunk_bytes": CHUNK, "timeout_s": 10.0, "lane_min_bytes": 0,
                                **config}  # fmt: skip
    comms: list[Communicator] = []
    try:
        for i in range(n):
            security = Security(key) if key is not None else None
            comms.append(Communicator(CommunicatorConfig(node_id=f"m{i}", **settings),
                                      security=security))  # fmt: skip
        yield comms
    finally:
        for c in comms:
            c.close()


def install(comms: list[Communicator], kind: str, epoch: int, keyed: bool = True) -> Topology:
    names = tuple(c.node_id for c in comms)
    addrs = {c.node_id: c.address for c in comms}
    keys = {c.node_id: c.public_key for c in comms} if keyed else None
    if kind == "ring":
        topo = Topology("ring", names, addrs, epoch, ring_order=names, keys=keys)
    else:
        parent = {m: (None if i == 0 else names[(i - 1) // 2]) for i, m in enumerate(names)}
        topo = Topology("tree", names, addrs, epoch, parent=parent, keys=keys)
    for c in comms:
        c.update_topology(topo)
    return topo


def inputs(n: int) -> list[torch.Tensor]:
    return [torch.randn(NUMEL, generator=torch.Generator().manual_seed(i)) for i in range(n)]


def results(comms: list[Communicator], xs: list[torch.Tensor], **kw: Any) -> list[torch.Tensor]:
    """Every member's result of one allreduce; each one must be the same tensor."""
    out = _results(comms, xs, **kw)
    assert all(torch.equal(r, out[0]) for r in out)
    return out


def lanes_of(comm: Communicator) -> Lanes:
    lanes = comm._lanes.lanes
    if lanes is None:
        raise AssertionError("lanes are off")
    return lanes


def lane_up(comms: list[Communicator], xs: list[torch.Tensor], sender: int, receiver: int) -> None:
    """Runs rounds until the lane from ``comms[sender]`` to ``comms[receiver]`` is up."""
    peer = comms[receiver].node_id
    for _ in range(ROUNDS):
        results(comms, xs, op="sum")
        lanes = comms[sender]._lanes.lanes
        if lanes is not None and peer in lanes.outgoing and lanes.outgoing[peer].ready:
            if comms[sender].node_id in lanes_of(comms[receiver]).incoming:
                return
    raise AssertionError("the lane never came up")


def dealer(address: str, routing_id: str, security: Security | None) -> tuple[zmq.Context, Any]:
    ctx: zmq.Context = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, routing_id.encode())
    if security is not None:
        security.client(sock)
    sock.connect(address)
    return ctx, sock


# ----------------------------------------------------------------------------- allreduce


@pytest.mark.parametrize("kind", ["ring", "tree"])
def test_keyed_members_allreduce_over_sealed_lanes_bitwise_equal_to_plain(kind: str) -> None:
    key = ClusterKey.generate()
    xs = inputs(4)
    with members(4, key) as secure, members(4, None) as plain:
        install(secure, kind, 1)
        install(plain, kind, 1, keyed=False)
        for _ in range(3):  # the first round sets the lanes up; later ones use them
            a = results(secure, xs, op="sum")
            b = results(plain, xs, op="sum")
            assert torch.equal(a[0].view(torch.int32), b[0].view(torch.int32))
        ref = torch.stack([x.double() for x in xs]).sum(0)
        torch.testing.assert_close(a[0].double(), ref, atol=1e-4, rtol=1e-5)
        assert all(lanes_of(c).sealed for c in secure)
        assert all(c.stats.lane_frames_received > 0 for c in secure)
        assert sum(c.stats.lane_frames_placed for c in secure) > 0  # opened straight into place
        for c in secure:
            assert c.stats.handshake_failures == c.stats.dropped_unauthenticated == 0
            assert c.stats.dropped_malformed == 0


def test_chunks_of_several_records_are_sealed_and_opened_in_parallel_bitwise() -> None:
    """Chunks larger than a lane record are sealed and opened record by record, by the record
    workers beside the threads that write and read them; a tampered middle record is caught."""
    key = ClusterKey.generate()
    big = [torch.randn(2_500_000, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    chunk = 3 * LANE_RECORD_BYTES + 1000  # three full records and a short one per chunk
    with members(3, key, chunk_bytes=chunk) as secure, members(3, None, chunk_bytes=chunk) as plain:
        install(secure, "ring", 1)
        install(plain, "ring", 1, keyed=False)
        for _ in range(3):
            a = results(secure, big, op="sum")
            b = results(plain, big, op="sum")
            assert torch.equal(a[0].view(torch.int32), b[0].view(torch.int32))
        assert all(c.stats.lane_frames_received > 0 for c in secure)
        seal = lanes_of(secure[2]).outgoing["m0"]._seal
        assert seal is not None
        honest = seal.seal_at
        calls: list[int] = []

        def flip_third(nonce: bytes, data: memoryview, out: memoryview) -> None:
            honest(nonce, data, out)
            calls.append(1)
            if len(calls) == 3:  # the third record of the next chunk, sealed by a worker
                out[7] ^= 0x10

        seal.seal_at = flip_third  # type: ignore[method-assign]
        step = secure[0]._driver._last_key[1] + 1
        first = run_all(secure, big, op="sum", step=step)
        seal.seal_at = honest  # type: ignore[method-assign]
        assert secure[0].stats.dropped_malformed >= 1
        if not all(isinstance(r, torch.Tensor) for r in first):
            install(secure, "ring", 2)
            results(secure, big, op="sum", step=step)
        out = results(secure, big, op="sum", step=step + 1)
        torch.testing.assert_close(out[0], torch.stack(big).sum(0), atol=1e-3, rtol=1e-5)


def test_a_topology_with_keys_needs_the_communicators_own_key() -> None:
    key = ClusterKey.generate()
    with members(2, key) as comms, members(1, None) as plain:
        names = ("m0", "m1")
        addrs = {c.node_id: c.address for c in comms}
        wrong = {"m0": comms[1].public_key, "m1": comms[1].public_key}
        with pytest.raises(ValueError, match="another public key"):
            comms[0].update_topology(Topology("ring", names, addrs, 1, ring_order=names,
                                              keys=wrong))  # fmt: skip
        solo = Topology("ring", ("m0",), {"m0": plain[0].address}, 1, ring_order=("m0",),
                        keys={"m0": comms[0].public_key})  # fmt: skip
        with pytest.raises(ValueError, match="cluster key"):
            plain[0].update_topology(solo)
    with pytest.raises(ValueError, match="public key"):
        Topology("ring", names, addrs, 1, ring_order=names, keys={"m0": "short"})


# ----------------------------------------------------------------------------- strangers


@pytest.mark.parametrize("who", ["no key", "another key"])
def test_a_stranger_cannot_connect_or_inject_frames(who: str) -> None:
    key = ClusterKey.generate()
    xs = inputs(3)
    security = None if who == "no key" else Security(ClusterKey.generate())
    with members(3, key) as comms:
        install(comms, "ring", 1)
        results(comms, xs, op="sum")
        target = comms[0]
        ctx, sock = dealer(target.address, "m2", security)  # claims to be m0's left neighbour
        try:
            for _ in range(ROUNDS):
                step = target._driver._last_key[1] + 1
                # an abort, and a kept result, of the next round: either would end it if read
                sock.send_multipart([encode_header(Op.ABORT, torch.float32, 0, 1, step, 0, 0),
                                     b"m1"], zmq.NOBLOCK)  # fmt: skip
                sock.send_multipart([encode_header(Op.RESULT, torch.float32, 0, 1, step, 0,
                                                   NUMEL), torch.zeros(NUMEL).numpy().tobytes()],
                                    zmq.NOBLOCK)  # fmt: skip
                out = results(comms, xs, op="sum")
                if target.stats.handshake_failures:
                    break
            assert target.stats.handshake_failures >= 1  # refused in the handshake, and counted
            torch.testing.assert_close(out[0], torch.stack(xs).sum(0), atol=1e-4, rtol=1e-5)
            assert target.stats.caught_up == 0 and target.stats.failures == 0
        finally:
            sock.close(linger=0)
            ctx.term()


def test_a_link_to_a_member_with_another_key_fails_the_round_with_a_clear_reason() -> None:
    with members(1, ClusterKey.generate()) as a, members(1, ClusterKey.generate()) as b:
        comms = [a[0], b[0]]
        names = ("m0", "m0b")
        # two clusters' members, put in one ring (no keys in the topology: the links fail alone)
        addrs = {"m0": a[0].address, "m0b": b[0].address}
        topo = Topology("ring", names, addrs, 1, ring_order=names)
        a[0].update_topology(topo)
        with pytest.raises(PeerFailure, match="CURVE handshake failed"):
            a[0].allreduce(torch.ones(8), "sum", timeout_s=20.0)
        assert comms[0].stats.handshake_failures >= 1


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed topology", "no keys (contrast)"])
def test_a_key_holder_cannot_send_as_another_member(keyed: bool) -> None:
    """A key holder connects to m1 under m2's id (m2, a member, has no link to m1 in this tree)
    and tells it that m2 runs the current step under a newer epoch, which would make m1's
    trainer abandon the round. Bound to the members' keys, m1 does not believe it: a frame of a
    later epoch waits for that epoch's topology, which refutes it."""
    key = ClusterKey.generate()
    xs = inputs(3)
    with members(3, key) as comms:
        install(comms, "tree", 1, keyed=keyed)  # m0 the root, m1 and m2 its children
        results(comms, xs, op="sum")
        target = comms[1]
        forger = Security(key)  # holds the cluster key, but is not m2
        ctx, sock = dealer(target.address, "m2", forger)
        try:
            for _ in range(ROUNDS):
                step = target._driver._last_key[1] + 1
                sock.send_multipart([encode_header(Op.NEWER, torch.float32, 0, 5, step, 0, 0),
                                     b""], zmq.NOBLOCK)  # fmt: skip
                out = results(comms, xs, op="sum")  # a NEWER notice fails no round by itself
                if target._peers._held or target.newer_round_seen():
                    break
            if keyed:
                assert target.newer_round_seen() is None
                assert target._peers._held  # read, and kept for epoch 5's keys
                install(comms, "tree", 5)  # the same members and keys
                assert target.stats.dropped_unauthenticated >= 1  # refuted, dropped
                assert not target._peers._held
                out = results(comms, xs, op="sum")
                assert target.newer_round_seen() is None
            else:
                assert target.newer_round_seen() == 5  # without keys the forgery is believed
                assert target.stats.dropped_unauthenticated == 0
            torch.testing.assert_close(out[0], torch.stack(xs).sum(0), atol=1e-4, rtol=1e-5)
        finally:
            sock.close(linger=0)
            ctx.term()


def test_a_connection_under_a_neighbours_id_is_ignored_while_the_neighbour_is_connected() -> None:
    """With a key the data endpoint never hands a member's id over to a new connection, so a key
    holder claiming a connected neighbour's id cannot cut that neighbour off."""
    key = ClusterKey.generate()
    xs = inputs(3)
    with members(3, key) as comms:
        install(comms, "ring", 1)
        results(comms, xs, op="sum")
        ctx, sock = dealer(comms[0].address, "m2", Security(key))  # m2 is m0's left neighbour
        try:
            for _ in range(3):
                step = comms[0]._driver._last_key[1] + 1
                sock.send_multipart([encode_header(Op.ABORT, torch.float32, 0, 1, step, 0, 0),
                                     b"m1"], zmq.NOBLOCK)  # fmt: skip
                results(comms, xs, op="sum")  # neither aborted nor cut off
            assert all(c.stats.failures == 0 for c in comms)
        finally:
            sock.close(linger=0)
            ctx.term()


def test_a_new_connection_gets_through_while_the_neighbour_still_holds_the_old_one() -> None:
    """After a route loss a member's old connection can stay half-open at its neighbour (its
    close never arrived) while the member connects again. Each socket has its own routing id,
    so the neighbour's data endpoint, which hands no id over with a key, takes the new
    connection's frames (with one id per member they were silently dropped: every round after
    a partition healed timed out on that link)."""
    key = ClusterKey.generate()
    xs = inputs(3)
    with members(3, key, lanes=False, timeout_s=5.0) as comms:  # every frame over the link
        install(comms, "ring", 1)
        results(comms, xs, op="sum")
        peers = comms[2]._peers
        stale = []
        for peer in peers.peers():  # m2 opens every link again; the old sockets stay open
            old = peers._links.pop(peer)
            peers.poller.unregister(old.monitor)
            stale.append(old)
            peers._links[peer] = peers._open_link(peer, old.address)
        try:
            for _ in range(3):
                out = results(comms, xs, op="sum")
            torch.testing.assert_close(out[0], torch.stack(xs).sum(0), atol=1e-4, rtol=1e-5)
            assert all(c.stats.failures == 0 for c in comms)
        finally:
            for old in stale:
                old.socket.disable_monitor()
                old.monitor.close(linger=0)
                old.socket.close(linger=0)


def test_routing_ids_name_the_member_and_differ_per_socket() -> None:
    ids = {routing_id("m-1.a:b") for _ in range(50)}
    assert len(ids) == 50
    assert {member_of(i) for i in ids} == {"m-1.a:b"}
    assert member_of(routing_id("m2", notice=True)) == "m2"
    assert member_of(b"m2") == "m2" and member_of(b"m2~notice") == "m2"


def test_a_member_with_a_new_key_in_a_later_epoch_is_held_until_that_epoch_vouches() -> None:
    """Frames of a later epoch from a member this node does not know yet (a joiner, or a member
    that restarted with a new key) wait for that epoch's topology, which vouches for them."""
    key = ClusterKey.generate()
    with members(2, key) as comms:
        install(comms, "ring", 1)
        peers = comms[0]._peers
        newcomer = Security(key)
        ctx, sock = dealer(comms[0].address, "m9", newcomer)
        try:
            sock.send_multipart([encode_header(Op.NEWER, torch.float32, 0, 2, 7, 0, 0), b""])
            parts = None
            for _ in range(200):  # the frame is read once it has arrived
                peers.poll(50)
                try:
                    parts = peers.recv_nowait()
                except zmq.Again:
                    if peers._held:
                        break
            assert parts is None and len(peers._held) == 1  # neither handed on nor dropped
            names = ("m0", "m9")
            addrs = {"m0": comms[0].address, "m9": comms[1].address}  # m9's: any endpoint
            keyed = {"m0": comms[0].public_key, "m9": newcomer.public_key}
            comms[0].update_topology(Topology("ring", names, addrs, 2, ring_order=names,
                                              keys=keyed))  # fmt: skip
            parts = peers.recv_nowait()  # vouched for by epoch 2: handed on
            assert parts[0].bytes == b"m9"
            assert comms[0].stats.dropped_unauthenticated == 0
        finally:
            sock.close(linger=0)
            ctx.term()


# ----------------------------------------------------------------------------- lanes


def test_sealed_offer_encoding() -> None:
    key = bytes(range(LANE_KEY_BYTES))
    assert decode_sealed_offer(encode_sealed_offer(4242, 7, key)) == (4242, 7, key)
    with pytest.raises(ProtocolError, match="bytes"):
        decode_sealed_offer(encode_sealed_offer(4242, 7, key)[:10])  # an offer without its key
    with pytest.raises(ValueError):
        LaneCipher(b"short", 0, 0)
    sealed = LaneCipher(key, 3, 0).seal(b"frame")
    assert LaneCipher(key, 3, 0).open(sealed) == b"frame"
    assert LaneCipher(key, 4, 0).open(sealed) is None  # another attempt: another nonce
    assert LaneCipher(key, 3, 1).open(sealed) is None  # the other direction


def _hellos(lanes: Lanes, peer: str) -> list[bytes]:
    """Hellos a stranger (or a replay) could send for the current offer to ``peer``."""
    offer = lanes._offers[peer]
    assert offer.key is not None and offer.accepted >= 0
    token = offer.token
    other = bytes(LANE_KEY_BYTES)
    return [
        encode_hello(peer, token),  # the token alone, in clear: useless with a key
        encode_sealed_hello(peer, token, LaneCipher(other, 1, 0), 1),  # another key
        # the real key's hello again, as recorded: the attempt was accepted already
        encode_sealed_hello(peer, token, LaneCipher(offer.key, offer.accepted, 0),
                            offer.accepted),  # fmt: skip
    ]


@pytest.mark.parametrize("which", [0, 1, 2], ids=["plain token", "other key", "replay"])
def test_a_lane_hello_without_the_lane_key_is_refused(which: int) -> None:
    key = ClusterKey.generate()
    xs = inputs(3)
    with members(3, key) as comms:
        install(comms, "ring", 1)
        lane_up(comms, xs, sender=2, receiver=0)
        lanes = lanes_of(comms[0])
        before = dict(lanes.incoming)
        rejected = lanes.rejected
        hello = _hellos(lanes, "m2")[which]
        with socket.create_connection(("127.0.0.1", lanes.port), timeout=5) as s:
            s.sendall(hello)
            for _ in range(ROUNDS):  # the node polls its listener while it runs
                results(comms, xs, op="sum")
                if lanes.rejected > rejected:
                    break
            s.settimeout(5)
            try:
                answer = s.recv(64)
            except ConnectionResetError:  # closed with the hello unread
                answer = b""
            assert answer == b""  # closed without an answer (no acknowledgement)
        assert lanes.rejected > rejected
        assert lanes.incoming == before  # the real lane was not replaced


@pytest.mark.parametrize("where", ["injected record", "tampered payload"])
def test_a_tampered_lane_frame_closes_the_lane_and_the_next_round_recovers(where: str) -> None:
    key = ClusterKey.generate()
    xs = inputs(3)
    with members(3, key, timeout_s=5.0) as comms:
        install(comms, "ring", 1)
        lane_up(comms, xs, sender=2, receiver=0)
        out_lane = lanes_of(comms[2]).outgoing["m0"]
        if where == "injected record":
            sock = out_lane._sock
            assert sock is not None
            # a header record's worth of bytes not sealed with the lane key
            sock.sendall(encode_header(Op.RING_ALLGATHER, torch.float32, 0, 1, 99, 0, 4)
                         + bytes(16))  # fmt: skip
        else:
            seal = out_lane._seal
            assert seal is not None
            honest = seal.seal_at

            def flip_once(nonce: bytes, data: memoryview, out: memoryview) -> None:
                honest(nonce, data, out)
                out[len(out) // 2] ^= 0x01  # one bit of a sealed payload, on the wire
                seal.seal_at = honest  # type: ignore[method-assign]

            seal.seal_at = flip_once  # type: ignore[method-assign]
        receiver = comms[0]
        step = receiver._driver._last_key[1] + 1
        # the frames from the bad one on are lost with the lane: the round may fail
        first = run_all(comms, xs, op="sum", step=step)
        assert receiver.stats.dropped_malformed >= 1
        if not all(isinstance(r, torch.Tensor) for r in first):
            assert all(isinstance(r, (PeerFailure, torch.Tensor)) for r in first), first
            install(comms, "ring", 2)  # every member reruns the step under a new epoch
            results(comms, xs, op="sum", step=step)
        received = receiver.stats.lane_frames_received
        for i in range(ROUNDS):  # the new lane connects in its own thread: rounds until used
            out = results(comms, xs, op="sum", step=step + 1 + i)
            if receiver.stats.lane_frames_received > received:
                break
        assert receiver.stats.lane_frames_received > received  # a new lane, with a new key
        torch.testing.assert_close(out[0], torch.stack(xs).sum(0), atol=1e-4, rtol=1e-5)
