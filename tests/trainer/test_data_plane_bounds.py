"""A cluster-key holder against a trainer's data plane: real trainers (each with its embedded
daemon) on loopback with one cluster key, and a key holder that never joined, a socket of this
test (:class:`~chaos.bench.forged_frames.KeyHolderSocket`: the cluster key, a keypair of its
own). It cannot pin the trainer's memory with frames of a later epoch (far ahead, or near but
more than the bytes bound), a frame over a port's ``MAXMSGSIZE`` drops its connection, and
connections that never handshake are dropped; the trainer trains on through all of it.

A trainer's RSS is read with psutil. The forged frames are 48 MiB each: above glibc's mmap
threshold (the data plane caps it at 32 MiB), so a frame's memory leaves the RSS as soon as it
is dropped, and under the data port's 64 MiB frame cap.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from chaos.bench.forged_frames import KeyHolderSocket, data_frame
from chaos.collectives.peers import MIN_MAX_MSG_BYTES
from chaos.launch import wait_until
from chaos.replication.server import MAX_MSG_BYTES
from chaos.security import ClusterKey, Security
from tests.trainer.trainer_cluster import KeyedCluster, Member, assert_equal_from, world

FRAME = 48 << 20
FRAMES = 12  # 576 MiB in all
GROWTH_LIMIT = 200 << 20  # the RSS growth the bounds allow: what was kept, and some slack
CAP = 64 << 20  # the near-epoch test's max_early_bytes: one forged frame fits, two do not
IDLE = 16  # idle connections opened to each port
HANDSHAKE_DEADLINE_S = 25.0
"""The ports drop a connection that has not handshaken in 5 s (``HANDSHAKE_IVL``); this
deadline is under ZeroMQ's default 30 s, so the test fails if the option were lost."""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[KeyedCluster]:
    with contextlib.closing(KeyedCluster(tmp_path)) as c:
        yield c


def endpoints(cluster: KeyedCluster, node_id: str) -> tuple[str, str]:
    """The trainer's allreduce endpoint and shard server, as its daemon reports them."""
    info = next(n for n in cluster.status(node_id).nodes if n.id == node_id)
    assert info.data_address and info.shard_address, info
    return info.data_address, info.shard_address


def rss(member: Member) -> int:
    return int(psutil.Process(member.proc.pid).memory_info().rss)


def full_log(member: Member) -> str:
    path = member.out.with_suffix(".log")
    return path.read_text(errors="replace") if path.exists() else ""


def key_holder(cluster: KeyedCluster) -> Security:
    """Security with the cluster key and a fresh keypair that no member has."""
    return Security(ClusterKey.load(cluster.key))


def steps_on(cluster: KeyedCluster, members: list[Member], more: int) -> int:
    """Waits until every member has stepped ``more`` steps past the first's last; returns
    that last step."""
    last = members[0].last().get("step", 0)
    size = len(members)
    cluster.wait(lambda: all(world(m, size, last + more) for m in members),
                 f"{more} more steps as {size}")  # fmt: skip
    return int(last)


def pair(cluster: KeyedCluster, *a_args: str) -> tuple[Member, Member]:
    """Trainers a (with ``a_args``) and b, training together."""
    a = cluster.start("a", None, *a_args)
    cluster.wait(lambda: a.last().get("step", 0) >= 3, "a to train")
    b = cluster.start("b", a)
    cluster.wait(lambda: world(a, 2) and world(b, 2), "b to join")
    steps_on(cluster, [a, b], 10)
    sync = cluster.status("a").sync
    assert sync is not None and set(sync.keys) == {"a", "b"}  # frames bound to the keys
    return a, b


def flood_and_check(cluster: KeyedCluster, a: Member, b: Member, epoch: Callable[[int], int],
                    logged: str) -> None:  # fmt: skip
    """The key holder sends :data:`FRAMES` frames of ``epoch(i)`` to a, claiming to be b; a's
    RSS must stay within :data:`GROWTH_LIMIT` of before while a and b train on, equal, and a
    must have logged the drops (``logged``)."""
    data, _ = endpoints(cluster, "a")
    before = rss(a)
    with KeyHolderSocket(data, key_holder(cluster), claim="b") as forger:
        forger.wait_for("handshakes", 1, 30.0)
        payload = bytes(FRAME)
        for i in range(FRAMES):
            forger.send(data_frame(epoch(i), 10**6 + i, FRAME, payload=payload), timeout_s=60.0)
        # until a read them: it logged a drop, or (without the bounds) it holds them
        cluster.wait(lambda: logged in full_log(a) or rss(a) - before > GROWTH_LIMIT,
                     "a to read the forged frames")  # fmt: skip
        first = steps_on(cluster, [a, b], 20)  # the rest of them read meanwhile
        grown = rss(a) - before
    assert grown < GROWTH_LIMIT, f"a's RSS grew by {grown >> 20} MiB after {FRAMES} frames"
    assert logged in full_log(a)
    assert assert_equal_from([a, b], first) >= 10


def test_a_key_holder_cannot_pin_a_trainers_memory_with_frames_of_a_far_epoch(
    cluster: KeyedCluster,
) -> None:
    """576 MiB of frames of epoch 10**9 (before the bound, a held them all for that epoch's
    keys, for good)."""
    a, b = pair(cluster)
    flood_and_check(cluster, a, b, lambda i: 10**9, "more than max_early_epochs=64 ahead")


def test_a_key_holder_cannot_pin_more_than_the_byte_bound_with_frames_of_the_next_epoch(
    cluster: KeyedCluster,
) -> None:
    """576 MiB of frames of the next epoch, which an honest joiner's could be: a keeps one
    (48 MiB, under its 64 MiB bound) and drops the others."""
    a, b = pair(cluster, "--max-early-bytes", str(CAP))
    sync = cluster.status("a").sync
    assert sync is not None
    flood_and_check(cluster, a, b, lambda i: sync.topology_epoch + 1,
                    f"exceed max_early_bytes={CAP}")  # fmt: skip


def test_a_frame_over_a_ports_bound_drops_its_connection_and_the_trainer_goes_on(
    cluster: KeyedCluster,
) -> None:
    a = cluster.start("a")
    cluster.wait(lambda: a.last().get("step", 0) >= 3, "a to train")
    data, shard = endpoints(cluster, "a")
    before = rss(a)
    security = key_holder(cluster)
    with KeyHolderSocket(data, security, claim="b") as to_data, \
            KeyHolderSocket(shard, security, claim="b") as to_shard:  # fmt: skip
        for sock in (to_data, to_shard):
            sock.wait_for("handshakes", 1, 30.0)
        to_data.send(data_frame(0, 0, MIN_MAX_MSG_BYTES + (1 << 20)), timeout_s=60.0)
        to_shard.send([bytes(MAX_MSG_BYTES + 1)])
        for sock in (to_data, to_shard):  # each port dropped the connection
            sock.wait_for("drops", 1, 60.0)
    steps_on(cluster, [a], 10)
    grown = rss(a) - before
    assert grown < GROWTH_LIMIT, f"a's RSS grew by {grown >> 20} MiB"


def test_connections_that_never_handshake_are_dropped(cluster: KeyedCluster) -> None:
    a = cluster.start("a")
    cluster.wait(lambda: a.last().get("step", 0) >= 3, "a to train")
    proc = psutil.Process(a.proc.pid)
    idle: list[socket.socket] = []
    try:
        for address in endpoints(cluster, "a"):
            host, port = address.removeprefix("tcp://").rsplit(":", 1)
            idle += [socket.create_connection((host, int(port)), timeout=5.0)
                     for _ in range(IDLE)]  # fmt: skip
        mine = {s.getsockname()[:2] for s in idle}

        def held() -> int:
            return sum(1 for c in proc.net_connections("tcp")
                       if c.raddr and (c.raddr.ip, c.raddr.port) in mine)  # fmt: skip

        cluster.wait(lambda: held() == 2 * IDLE, "a to accept the idle connections")
        wait_until(lambda: held() == 0, HANDSHAKE_DEADLINE_S, "a to drop the idle connections",
                   poll_s=0.2, watch={"a": a.proc})  # fmt: skip
    finally:
        for s in idle:
            s.close()
    steps_on(cluster, [a], 5)
