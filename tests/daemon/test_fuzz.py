"""Bad input on every socket of a live daemon: it stays up and answers the next good request."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from daemon_helpers import Cluster, Node
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chaos.protocol import (
    PROTOCOL_VERSION,
    BulkData,
    ClusterUpdate,
    ClusterView,
    LinkRequest,
    MemberHeartbeat,
    Ping,
    Refusal,
    StatusReply,
    StatusRequest,
    SyncPolicyWire,
    decode,
    encode,
)

# Tags a fuzzer must not hit with a well-formed body: they would make the daemon leave or
# inject faults, which is legitimate behaviour rather than bad input.
_SAFE_TAGS = [
    "scheduler_heartbeat",
    "member_heartbeat",
    "request_vote",
    "vote_reply",
    "timeout_now",
    "join_request",
    "leave_request",
    "link_request",
    "connect_command",
    "link_report",
    "agent_report",
    "cluster_update",
    "policy_ack",
    "ping",
    "pong",
    "bulk_data",
    "bulk_ack",
    "op_result",
    "refusal",
    "status_reply",
    "fault_reply",
    "policy_reply",
    "trainer_register",
    "trainer_info",
    "trainer_ready",
    "trainer_gone",
    "pull_done",
    "step_failed",
    "caught_up",
    "trainer_progress",
    "nonfinite_step",
    "trainer_throughput",
    "nonsense",
]

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=20),
    st.binary(max_size=64),
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_bodies = st.fixed_dictionaries(
    {"type": st.sampled_from(_SAFE_TAGS)},
    optional={
        "v": st.sampled_from([PROTOCOL_VERSION, 0, 2, -1, "1"]),
        "sender": st.sampled_from(["", "n1", "stranger", "x" * 70]),
        "epoch": st.integers(-5, 2**40),
        "term": st.integers(-5, 2**40),
        "node_id": st.text(max_size=70),
        "address": st.text(max_size=40),
        "seq": _values,
        "payload": _values,
        "view": _values,
        "data_address": st.sampled_from(["tcp://127.0.0.1:1", "ipc:///tmp/x", "http://x", ""]),
        "shard_address": _values,
        "has_state": _values,
        "tensor_sizes": st.one_of(_values, st.lists(st.integers(-(2**70), 2**70), max_size=8)),
        "step": st.integers(-5, 2**60),
        "devices": _values,
        "detail": _values,
    },
)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Node]]:
    c = Cluster(Path(tmp_path_factory.mktemp("fuzz")))
    try:
        yield c, c.spawn("n1")
    finally:
        c.close()


@pytest.fixture(scope="module")
def sockets(live: tuple[Cluster, Node]) -> Iterator[dict[str, zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socks = {}
    for name, ep in (("tcp", live[1].address), ("ipc", live[1].ipc)):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(ep)
        socks[name] = s
    yield socks
    for s in socks.values():
        s.close()
    ctx.term()


def _ask(sock: zmq.Socket[bytes], frames: list[bytes]) -> list[bytes]:
    """Sends frames, then a status request; returns every answer up to the status reply."""
    sock.send_multipart(frames)
    sock.send(encode(StatusRequest()))
    answers = []
    while True:
        assert sock.poll(5000), "daemon did not answer the good request"
        raw = sock.recv_multipart()[-1]
        answers.append(raw)
        if isinstance(decode(raw, 1 << 24), StatusReply):
            return answers


def _refusals(answers: list[bytes]) -> list[str]:
    out = []
    for raw in answers:
        msg = decode(raw, 1 << 24)
        if isinstance(msg, Refusal):
            out.append(msg.reason.value)
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frame=st.binary(max_size=2048), which=st.sampled_from(["tcp", "ipc"]))
def test_random_bytes(
    sockets: dict[str, zmq.Socket[bytes]], live: tuple[Cluster, Node], frame: bytes, which: str
) -> None:
    _ask(sockets[which], [frame])
    assert live[1].alive()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=_bodies, which=st.sampled_from(["tcp", "ipc"]))
def test_structured_garbage(
    sockets: dict[str, zmq.Socket[bytes]],
    live: tuple[Cluster, Node],
    body: dict[str, object],
    which: str,
) -> None:
    try:
        frame = msgspec.msgpack.encode(body)
    except (OverflowError, TypeError):
        return
    _ask(sockets[which], [frame])
    assert live[1].alive()


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=st.lists(st.binary(max_size=64), min_size=0, max_size=4))
def test_multipart_garbage(
    sockets: dict[str, zmq.Socket[bytes]], live: tuple[Cluster, Node], frames: list[bytes]
) -> None:
    if len(frames) in (0, 1) or (len(frames) == 2 and frames[0] == b""):
        frames = [*frames, b"x", b"y"]
    _ask(sockets["tcp"], frames)
    assert live[1].alive()


@pytest.fixture(scope="module")
def quiet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Node, zmq.Socket[bytes]]]:
    """A daemon no fuzzer has touched, and a DEALER to it.

    The reason codes need the daemon still the scheduler of its one-node cluster: a fuzzed
    scheduler heartbeat that happens to be well formed (from any sender, of a higher term) makes
    the fuzzed daemon follow that sender, as a member must.
    """
    c = Cluster(Path(tmp_path_factory.mktemp("reasons")))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        node = c.spawn("n1")
        sock.connect(node.address)
        yield node, sock
    finally:
        sock.close()
        ctx.term()
        c.close()


def test_reason_codes(quiet: tuple[Node, zmq.Socket[bytes]]) -> None:
    node, tcp = quiet
    assert _refusals(_ask(tcp, [b"\xc1garbage"])) == ["malformed"]
    assert _refusals(_ask(tcp, [msgspec.msgpack.encode({"v": 99, "type": "ping"})])) == [
        "bad_version"
    ]
    assert _refusals(_ask(tcp, [b"\x00" * (2 << 20)])) == ["too_large"]
    hb = MemberHeartbeat(sender="stranger", epoch=1, term=1)
    assert _refusals(_ask(tcp, [encode(hb)])) == ["unknown_peer"]
    st_ = node.status()
    view = ClusterView(epoch=0, term=st_.term, scheduler="n1", nodes=[], links=[])
    stale = ClusterUpdate(
        sender="n9",
        epoch=0,
        term=st_.term,
        view=view,
        sync=SyncPolicyWire(kind="single", nodes=["n1"]),
    )
    assert _refusals(_ask(tcp, [encode(stale)])) == ["stale_epoch"]
    old_term = msgspec.structs.replace(stale, term=0, epoch=st_.epoch + 5)
    assert _refusals(_ask(tcp, [encode(old_term)])) == ["stale_term"]
    lr = LinkRequest(sender="n1", a="n1", b="zz", op="connect")  # n1 is a member: goes through
    assert _refusals(_ask(tcp, [encode(lr)])) == []
    # a probe chunk's bytes are a raw attachment frame, checked against its declared size
    chunk = BulkData(sender="zz", probe_id="zz-1", index=0, count=1, size=8)
    assert _refusals(_ask(tcp, [encode(chunk), b"12345678"])) == []
    assert _refusals(_ask(tcp, [encode(chunk), b"1234"])) == ["malformed"]
    assert _refusals(_ask(tcp, [encode(chunk)])) == ["malformed"]
    assert _refusals(_ask(tcp, [encode(Ping(sender="zz", seq=1, t=0.0)), b"x"])) == ["malformed"]
    assert _refusals(_ask(tcp, [encode(chunk), b"12345678", b"extra"])) == ["malformed"]
    assert node.alive()
    assert node.status().state == "active"
