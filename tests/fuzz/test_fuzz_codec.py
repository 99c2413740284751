"""Fuzzing the control plane's decoder (:mod:`chaos.protocol.codec`).

The contract: :func:`~chaos.protocol.codec.validate` never raises on bad input (it returns a
:class:`~chaos.protocol.codec.Rejected` with a reason code), and
:func:`~chaos.protocol.codec.decode` raises nothing but :class:`~chaos.errors.ProtocolError`.
"""

from __future__ import annotations

import typing
from typing import Any

import msgspec
import pytest
from fuzz_strategies import (
    byte_mutations,
    deep_array,
    deep_field,
    deep_map,
    field_mutations,
    msgpack_values,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from chaos.errors import ProtocolError
from chaos.protocol import codec
from chaos.protocol import messages as m

_VIEW = m.ClusterView(
    epoch=3,
    term=2,
    scheduler="n1",
    nodes=[
        m.NodeInfo(
            id="n1",
            address="tcp://127.0.0.1:5000",
            state=m.NodeState.ACTIVE,
            joined_at=1.0,
            neighbors=["n2"],
            resources=m.Resources(cpu_percent=1.0),
            data_address="tcp://127.0.0.1:5001",
        )
    ],
    links=[m.LinkInfo(a="n1", b="n2", bandwidth_bps=1e6, latency_s=0.001)],
)
_SYNC = m.SyncPolicyWire(
    kind="tree",
    nodes=["n1", "n2"],
    root="n1",
    parents={"n1": None, "n2": "n1"},
    addresses={"n1": "tcp://127.0.0.1:5001"},
    topology_epoch=3,
)
_REPL = m.ReplicationWire(
    target="n2",
    shard_size=1024,
    assignment={"n1": [(0, 1024)]},
    donor_addresses={"n1": "tcp://127.0.0.1:5002"},
    donors=[m.DonorLink(id="n1", prop_s=0.001, trans_s_per_byte=1e-9)],
    tensor_sizes=[1024],
)
_POLICY = m.PolicyReply(epoch=3, term=2, members=["n1", "n2"], sync=_SYNC, replication=_REPL)
_TCP = "tcp://127.0.0.1:5000"

EXAMPLES: list[m.Message] = [
    m.SchedulerHeartbeat(sender="n1", epoch=3, term=2),
    m.MemberHeartbeat(sender="n2", epoch=3, term=2, resources=m.Resources(battery_percent=50.0)),
    m.RequestVote(sender="n2", epoch=3, term=4, transfer=True),
    m.VoteReply(sender="n1", epoch=3, term=4, granted=True),
    m.TimeoutNow(sender="n1", epoch=3, term=2),
    m.JoinRequest(
        sender="n3",
        node_id="n3",
        address=_TCP,
        neighbors=["n1"],
        state_bytes=10,
        tensor_sizes=[4, 6],
        forwarded_by="n1",
        op_id="op",
    ),
    m.LeaveRequest(sender="n2", epoch=3, node_id="n2", op_id="op"),
    m.LinkRequest(sender="n2", epoch=3, a="n2", b="n1", op="connect", premeasured=True),
    m.ConnectCommand(sender="n1", epoch=3, term=2, peer="n2", address=_TCP),
    m.LinkReport(
        sender="n2", epoch=3, term=2, peer="n1", up=True, latency_s=0.001, bandwidth_bps=1e9
    ),
    m.AgentReport(
        sender="n2",
        epoch=3,
        term=2,
        address=_TCP,
        joined_at=1.0,
        links=[m.LinkInfo(a="n1", b="n2")],
        tensor_sizes=[8],
    ),
    m.ClusterUpdate(
        sender="n1",
        epoch=3,
        term=2,
        view=_VIEW,
        sync=_SYNC,
        replication=_REPL,
        cause="join",
        op_id="op",
    ),
    m.PolicyAck(sender="n2", epoch=3, term=2),
    m.Ping(sender="n1", seq=7, t=1.5),
    m.Pong(sender="n2", seq=7, t=1.5),
    m.BulkData(sender="n1", probe_id="p", index=0, count=2, size=4),
    m.BulkAck(sender="n2", probe_id="p", received_bytes=8),
    m.OpResult(sender="n1", op_id="op", ok=False, reason=m.Reason.PAUSED, detail="d"),
    m.Refusal(sender="n1", reason=m.Reason.STALE_TERM, term=2, scheduler="n1", req_id=3),
    m.StatusRequest(),
    m.StatusReply(
        sender="n1",
        epoch=3,
        node_id="n1",
        role="scheduler",
        state="active",
        paused=False,
        scheduler="n1",
        term=2,
        nodes=_VIEW.nodes,
        links=_VIEW.links,
        sync=_SYNC,
        notes=["x"],
    ),
    m.LeaveCommand(),
    m.LinkCommand(peer="n2", op="disconnect"),
    m.FaultCommand(name="drop_to", peers=["n2"]),
    m.FaultReply(active=["drop_to n2"]),
    m.PolicyRequest(),
    _POLICY,
    m.PolicyNotice(epoch=3, paused=True, interval_s=1.0, policy=_POLICY),
    m.TrainerRegister(
        data_address=_TCP,
        shard_address="ipc:///tmp/s",
        has_state=True,
        tensor_sizes=[16],
        state_digest="ab",
        pid=12,
    ),
    m.TrainerInfo(
        sender="n2",
        epoch=3,
        node_id="n2",
        data_address=_TCP,
        shard_address=_TCP,
        has_state=False,
        tensor_sizes=[16],
    ),
    m.TrainerEvent(kind="ready", node_id=None, elapsed_s=1.0),
]
"""One well-formed instance of every control-plane message, most optional fields set."""

_FRAMES = [codec.encode(msg) for msg in EXAMPLES]
_MAPS: list[dict[str, Any]] = [msgspec.msgpack.decode(f) for f in _FRAMES]

_CONTEXTS = [
    codec.ValidationContext(
        max_frame_bytes=1 << 20,
        epoch=3,
        term=2,
        members=frozenset({"n1", "n2"}),
        is_scheduler=True,
        paused=False,
        joining=False,
        node_id="n1",
    ),
    codec.ValidationContext(
        max_frame_bytes=256,
        epoch=0,
        term=0,
        members=frozenset(),
        is_scheduler=False,
        paused=True,
        joining=True,
    ),
]


def _check(frame: bytes, attachment: bytes | None = None) -> None:
    """The property: ``validate`` returns a message or a refusal, ``decode`` raises only
    ``ProtocolError``, whatever ``frame`` is."""
    for ctx in _CONTEXTS:
        got = codec.validate(frame, ctx, attachment)
        if isinstance(got, codec.Rejected):
            assert isinstance(got.refusal, m.Refusal)
            assert isinstance(got.refusal.reason, m.Reason)
        else:
            assert isinstance(got, typing.get_args(m.Message))
    try:
        codec.decode(frame, 1 << 20)
    except ProtocolError:
        pass


def test_every_message_type_has_an_example() -> None:
    assert {type(x) for x in EXAMPLES} == set(typing.get_args(m.Message))


@pytest.mark.parametrize("frame", _FRAMES, ids=[codec.tag_of(x) for x in EXAMPLES])
def test_examples_decode(frame: bytes) -> None:
    assert codec.encode(codec.decode(frame)) == frame


@settings(max_examples=300)
@given(frame=st.binary(max_size=512))
def test_random_bytes(frame: bytes) -> None:
    _check(frame)


@settings(max_examples=300)
@given(frame=msgpack_values)
def test_random_msgpack(frame: bytes) -> None:
    _check(frame)


_OPEN_BUG_UTF8 = pytest.mark.skip(
    reason="codec: msgspec raises UnicodeDecodeError on a string that is not UTF-8, "
    "e.g. b'\\x82\\xa1v\\x03\\xa4type\\xa1\\x80'; validate() lets it through"
)
_OPEN_BUG_DEPTH = pytest.mark.skip(
    reason="codec: msgspec raises RecursionError on nesting deeper than its limit (an unknown "
    "field of ~1,000 nested arrays); validate() lets it through"
)


@_OPEN_BUG_UTF8
def test_not_utf8() -> None:
    for base in _MAPS:
        _check(msgspec.msgpack.encode({**base, "type": "x"}).replace(b"\xa1x", b"\xa1\x80"))
        _check(msgspec.msgpack.encode({**base, "sender": "x"}).replace(b"\xa1x", b"\xa1\x80"))


@_OPEN_BUG_UTF8
@settings(max_examples=600)
@given(data=st.data(), i=st.integers(0, len(_FRAMES) - 1))
def test_byte_mutations_of_every_type(data: st.DataObject, i: int) -> None:
    _check(data.draw(byte_mutations(_FRAMES[i])))


@settings(max_examples=600)
@given(data=st.data(), i=st.integers(0, len(_MAPS) - 1))
def test_field_mutations_of_every_type(data: st.DataObject, i: int) -> None:
    _check(data.draw(field_mutations(_MAPS[i])))


@settings(max_examples=100)
@given(attachment=st.one_of(st.none(), st.binary(max_size=8)), i=st.integers(0, len(_FRAMES) - 1))
def test_attachments(attachment: bytes | None, i: int) -> None:
    _check(_FRAMES[i], attachment)


@pytest.mark.parametrize(
    "frame",
    [deep_array(), pytest.param(deep_map(), marks=_OPEN_BUG_DEPTH)],
    ids=["array", "map"],
)
def test_deep_nesting(frame: bytes) -> None:
    _check(frame)


@_OPEN_BUG_DEPTH
@pytest.mark.parametrize("i", range(len(_MAPS)), ids=[codec.tag_of(x) for x in EXAMPLES])
def test_deep_nesting_in_a_field(i: int) -> None:
    """An unknown field (skipped by the schema) and a known one, nested past the recursion
    limit."""
    _check(deep_field(_MAPS[i], "extra"))
    _check(deep_field(_MAPS[i], sorted(_MAPS[i])[-1]))


@pytest.mark.parametrize("huge", [2**64 - 1, 2**63, 2**53, -(2**63)])
@pytest.mark.parametrize("key", ["epoch", "term", "seq", "size", "req_id", "v"])
def test_huge_integers(huge: int, key: str) -> None:
    for base in _MAPS:
        _check(msgspec.msgpack.encode({**base, key: huge}))
