"""A keyed cluster: real daemons with one cluster key; strangers and other keys are refused.

Every daemon here gets the key through its TOML config (``cluster_key = PATH``), the same
setting as ``--cluster-key``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from chaos.daemon.client import DaemonClient

from chaos.errors import ProtocolError
from chaos.protocol import (
    ClusterUpdate,
    ClusterView,
    ConnectCommand,
    FaultCommand,
    JoinRequest,
    LeaveCommand,
    LeaveRequest,
    LinkCommand,
    MemberHeartbeat,
    Refusal,
    RequestVote,
    SchedulerHeartbeat,
    StatusRequest,
    SyncPolicyWire,
    TrainerRegister,
    decode,
    encode,
)
from chaos.security import ClusterKey, Security
from tests.daemon.daemon_helpers import Cluster, Node, wait_until


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[tuple[Cluster, Path]]:
    key = ClusterKey.generate().write(tmp_path / "cluster.key")
    cluster = Cluster(tmp_path)
    cluster.config.write_text(cluster.config.read_text() + f'cluster_key = "{key}"\n')
    try:
        yield cluster, key
    finally:
        cluster.close()


def keyed_status(node: Node, key: Path | None, timeout_s: float = 2.0) -> object:
    sec = Security.from_key_file(key) if key is not None else Security()
    with DaemonClient(node.address, timeout_s=timeout_s, security=sec) as c:
        return c.status()


def start_keyed(cluster: Cluster, key: Path, n: int) -> list[Node]:
    first = cluster.spawn("n1", wait=False)
    nodes = [first]
    wait_until(lambda: keyed_status(first, key).state == "active", "n1 active")
    for i in range(2, n + 1):
        node = cluster.spawn(f"n{i}", join=nodes[-1], neighbors=(nodes[-1].id,), wait=False)
        wait_until(lambda node=node: keyed_status(node, key).state == "active", f"n{i} active")
        nodes.append(node)
    ids = {x.id for x in nodes}
    wait_until(
        lambda: all({m.id for m in keyed_status(x, key).nodes} == ids for x in nodes),
        "everyone sees everyone",
    )
    return nodes


def raw_answers(node: Node, frames: list[bytes], sec: Security, wait_s: float) -> list[bytes]:
    """Sends raw frames over one DEALER with ``sec``; every answer that came within ``wait_s``
    after the last one (a status request last: a daemon that reads anything answers it)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sec.client(sock)
    sock.connect(node.address)
    answers: list[bytes] = []
    try:
        for frame in frames:
            sock.send(frame)
        while sock.poll(int(wait_s * 1000), zmq.POLLIN):
            answers.append(sock.recv_multipart()[-1])
        return answers
    finally:
        sock.close(linger=0)
        ctx.term()


def raw_request(node: Node, frame: bytes, sec: Security, timeout_s: float = 5.0) -> bytes | None:
    """Sends one raw frame over a DEALER with ``sec``; the answer, or ``None`` if none came."""
    answers = raw_answers(node, [frame], sec, timeout_s)
    return answers[0] if answers else None


def test_a_keyed_cluster_forms_and_refuses_strangers_and_other_keys(
    keyed: tuple[Cluster, Path], tmp_path: Path
) -> None:
    cluster, key = keyed
    n1, n2, n3 = start_keyed(cluster, key, 3)
    view = keyed_status(n1, key)
    assert all(len(n.public_key) == 40 for n in view.nodes)  # every id bound to a key
    assert len({n.public_key for n in view.nodes}) == 3

    other = ClusterKey.generate().write(tmp_path / "other.key")
    for sec_key in (None, other):
        with pytest.raises(ProtocolError, match="refused the connection"):
            keyed_status(n2, sec_key, timeout_s=5.0)
    # a stranger's forged messages never reach the daemon: no answer, and nothing changes
    stranger = Security()
    e, t = view.epoch, view.term
    evil_view = ClusterView(epoch=e + 5, term=t + 5, scheduler="n3", nodes=[], links=[])
    forged = [
        StatusRequest(sender=""),
        LeaveCommand(),
        LinkCommand(peer="n3", op="disconnect"),
        FaultCommand(name="partition", peers=["n1"]),
        LeaveRequest(sender="n2", epoch=e, node_id="n2"),
        MemberHeartbeat(sender="n3", epoch=e, term=t),
        SchedulerHeartbeat(sender="evil", epoch=e, term=t + 50),
        RequestVote(sender="n3", epoch=e + 1, term=t + 50, transfer=True),
        ClusterUpdate(sender="n3", epoch=e + 5, term=t + 5, view=evil_view,
                      sync=SyncPolicyWire(kind="single", nodes=[])),
        ConnectCommand(sender="n1", epoch=e, term=t, peer="n3", address="tcp://127.0.0.1:9"),
        JoinRequest(sender="evil", node_id="evil", address="tcp://127.0.0.1:9"),
        TrainerRegister(data_address="tcp://127.0.0.1:9", shard_address="tcp://127.0.0.1:8",
                        has_state=True),
    ]  # fmt: skip
    frames = [encode(m) for m in forged] + [encode(StatusRequest(sender=""))]
    holder = Security.from_key_file(key)  # the status probe works for a key holder
    assert len(raw_answers(n1, frames[-1:], holder, 2.0)) == 1
    for target in (n1, n2):
        for sec in (stranger, Security.from_key_file(other)):
            assert raw_answers(target, frames, sec, 2.0) == []
    after = keyed_status(n1, key)
    assert {m.id for m in after.nodes} == {"n1", "n2", "n3"}
    assert after.term == t and after.scheduler == view.scheduler
    assert all(n.alive() for n in (n1, n2, n3))
    log = (n1.run_dir / "stderr.log").read_text()
    assert "CURVE handshake failed" in log  # each refusal is logged


def test_a_key_holder_cannot_speak_for_another_member(keyed: tuple[Cluster, Path]) -> None:
    cluster, key = keyed
    n1, n2, n3 = start_keyed(cluster, key, 3)
    view = keyed_status(n1, key)
    scheduler = next(n for n in (n1, n2, n3) if n.id == view.scheduler)
    holder = Security.from_key_file(key)  # holds the key, but is not n2's daemon
    leave = LeaveRequest(sender="n2", epoch=view.epoch, node_id="n2")
    answer = raw_request(scheduler, encode(leave), holder)
    assert answer is not None
    refusal = decode(answer, 1 << 22)
    assert isinstance(refusal, Refusal) and refusal.reason.value == "not_authenticated"
    # a join must name the key of its own connection
    join = JoinRequest(sender="x1", node_id="x1", address="tcp://127.0.0.1:9",
                       public_key=Security().public_key)  # fmt: skip
    answer = raw_request(scheduler, encode(join), holder)
    assert answer is not None
    assert decode(answer, 1 << 22).reason.value == "not_authenticated"
    assert {m.id for m in keyed_status(n1, key).nodes} == {"n1", "n2", "n3"}
    assert any(e.get("event") == "refused_sender" for e in scheduler.events())
