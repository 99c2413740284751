"""Protocol validation, config loading and CLI argument errors (in-process, no daemons)."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from chaos.daemon.cli import main
from chaos.daemon.client import DaemonClient
from chaos.daemon.config import IPC_PATH_MAX, DaemonConfig, ipc_endpoint_for, load_config
from chaos.daemon.election import Election
from chaos.daemon.states import Role
from click.testing import CliRunner

from chaos.errors import ConfigError, ProtocolError
from chaos.launch import free_tcp_address
from chaos.protocol import (
    PROTOCOL_VERSION,
    BulkData,
    ClusterUpdate,
    ClusterView,
    JoinRequest,
    LeaveCommand,
    LinkRequest,
    MemberHeartbeat,
    Ping,
    Reason,
    Rejected,
    RequestVote,
    SyncPolicyWire,
    ValidationContext,
    VoteReply,
    decode,
    encode,
    validate,
)
from chaos.trainer.embedded import EmbeddedDaemon

CTX = ValidationContext(
    max_frame_bytes=1 << 16,
    epoch=5,
    term=3,
    members=frozenset({"a", "b"}),
    is_scheduler=True,
    paused=False,
    joining=False,
    node_id="a",
)


def _reason(frame: bytes, ctx: ValidationContext = CTX) -> str | None:
    r = validate(frame, ctx)
    return r.refusal.reason.value if isinstance(r, Rejected) else None


def test_round_trip_and_refusals() -> None:
    join = JoinRequest(sender="j", node_id="j", address="tcp://127.0.0.1:9", neighbors=["a"])
    assert decode(encode(join)) == join
    assert _reason(encode(Ping(sender="x", seq=1, t=0.5))) is None
    assert _reason(b"\x93\x01\x02") == "malformed"
    newer = msgspec.msgpack.encode({"v": PROTOCOL_VERSION + 1, "type": "ping"})
    assert _reason(newer) == "bad_version"
    # a frame of another version is refused as such whether or not it fits this version's schema
    other, v = PROTOCOL_VERSION - 1, PROTOCOL_VERSION
    assert _reason(msgspec.msgpack.encode({"v": other, "type": "ping", "sender": "x"})) == (
        "bad_version"
    )
    assert _reason(msgspec.msgpack.encode({"v": other, "type": "ping", "seq": "?"})) == (
        "bad_version"
    )
    assert _reason(msgspec.msgpack.encode({"v": v, "type": "ping", "seq": "?"})) == "malformed"
    assert _reason(msgspec.msgpack.encode({"v": v, "type": "no_such"})) == "malformed"
    # no version field at all: refused, although every field of a ping has a default
    assert _reason(msgspec.msgpack.encode({"type": "ping", "sender": "x"})) == "bad_version"
    assert _reason(b"x" * (1 << 17)) == "too_large"
    assert _reason(encode(MemberHeartbeat(sender="zz", term=3))) == "unknown_peer"
    view = ClusterView(epoch=4, term=3, scheduler="b", nodes=[], links=[])
    upd = ClusterUpdate(
        sender="b", epoch=4, term=3, view=view, sync=SyncPolicyWire(kind="single", nodes=["a"])
    )
    assert _reason(encode(upd)) == "stale_epoch"
    assert _reason(encode(msgspec.structs.replace(upd, epoch=6, term=2))) == "stale_term"
    joining = ValidationContext(**{**CTX.__dict__, "joining": True})
    assert _reason(encode(upd), joining) is None  # a joiner adopts the cluster's epoch and term
    follower = ValidationContext(**{**CTX.__dict__, "is_scheduler": False})
    lr = LinkRequest(sender="b", a="b", b="a", op="connect")
    assert _reason(encode(lr), follower) == "not_scheduler"
    paused = ValidationContext(**{**CTX.__dict__, "paused": True})
    assert _reason(encode(LeaveCommand()), paused) == "paused"
    bad_id = msgspec.msgpack.encode({"v": v, "type": "ping", "sender": "x", "seq": -1, "t": 0.0})
    assert _reason(bad_id) == "malformed"
    with pytest.raises(ProtocolError):
        decode(b"\xc1")
    with pytest.raises(ProtocolError):
        encode("not a message")  # type: ignore[arg-type]
    assert f"{Reason.TOO_LARGE}" == "too_large"


def test_bulk_data_comes_with_exactly_its_attachment() -> None:
    """A probe chunk's bytes travel as a raw attachment frame; validate() checks it, and refuses
    an attachment on any other message."""
    chunk = BulkData(sender="b", probe_id="b-1", index=0, count=2, size=4)
    frame = encode(chunk)
    assert validate(frame, CTX, b"abcd") == chunk

    def reason(f: bytes, attachment: bytes | None, ctx: ValidationContext = CTX) -> str | None:
        r = validate(f, ctx, attachment)
        return r.refusal.reason.value if isinstance(r, Rejected) else None

    assert reason(frame, None) == "malformed"  # the bytes are missing
    assert reason(frame, b"abc") == "malformed"  # shorter than declared
    assert reason(frame, b"abcde") == "malformed"
    assert reason(encode(Ping(sender="b", seq=1, t=0.0)), b"x") == "malformed"
    big = encode(msgspec.structs.replace(chunk, size=CTX.max_frame_bytes + 1))
    assert reason(big, b"") == "too_large"  # checked before the attachment is looked at
    # the old schema, with the bytes inside the message, is another protocol version
    old = msgspec.msgpack.encode(
        {"v": PROTOCOL_VERSION - 1, "type": "bulk_data", "sender": "b", "probe_id": "b-1",
         "index": 0, "count": 1, "payload": b"abcd"}
    )  # fmt: skip
    assert reason(old, None) == "bad_version"


def _cfg(**kw: object) -> DaemonConfig:
    return DaemonConfig(node_id="a", listen="tcp://127.0.0.1:5000", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kw",
    [
        {"heartbeat_interval_s": -1.0},
        {"heartbeat_interval_s": 1.0, "failure_timeout_s": 1.5},
        {"failure_timeout_s": float("nan")},
        {"election_timeout_min_s": 1.0},
        {"link_failure_timeout_s": 1.0},
        {"max_frame_bytes": 100},
        {"metrics_port": 70000},
        {"join": "tcp://127.0.0.1:5000"},
        {"join": "udp://x:1"},
        {"neighbors": ("a",)},
        {"faults": ("explode:b",)},
        {"faults": ("cut_link:b",)},  # presets need enable_fault_injection
        {"enable_fault_injection": "yes"},
        {"max_peer_sockets": 0},
        {"max_peer_sockets": 5000},
        {"max_measurements": -1},
        {"join_rate_per_s": 0.0},
        {"join_burst": 1.5},
        {"metrics_host": ""},
        {"ipc_endpoint": "/tmp/x"},
        {"ipc_endpoint": "ipc:///tmp/" + "x" * 120},
    ],
)
def test_bad_config_values(kw: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        _cfg(**kw)


def test_deep_run_dir_gets_a_short_ipc_path(tmp_path: Path) -> None:
    """A run directory too deep for a unix socket address still yields a bindable endpoint."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    endpoint = ipc_endpoint_for(str(deep))
    assert len(endpoint.removeprefix("ipc://").encode()) <= IPC_PATH_MAX
    assert endpoint == ipc_endpoint_for(str(deep))  # every client derives the same one
    assert endpoint != ipc_endpoint_for(str(tmp_path / "other" / ("d" * 60) / ("e" * 60)))
    assert ipc_endpoint_for(str(tmp_path)) == f"ipc://{tmp_path / 'daemon.ipc'}"
    daemon = EmbeddedDaemon("deep", free_tcp_address(), None, run_dir=str(deep))
    try:
        daemon.wait_ready(20.0)
        with DaemonClient(daemon.endpoint, timeout_s=5.0) as client:
            assert [n.id for n in client.status().nodes] == ["deep"]
    finally:
        daemon.stop()


def test_config_precedence(tmp_path: Path) -> None:
    f = tmp_path / "d.toml"
    f.write_text(
        'node_id = "file"\nlisten = "tcp://127.0.0.1:7000"\nheartbeat_interval_s = 0.2\n'
        "failure_timeout_s = 1.0\n"
    )
    cfg = load_config({"node_id": "cli", "heartbeat_interval_s": None}, f)
    assert cfg.node_id == "cli"  # CLI over file
    assert cfg.heartbeat_interval_s == 0.2  # file over default
    assert cfg.link_probe_interval_s == DaemonConfig.link_probe_interval_s  # default
    (tmp_path / "bad.toml").write_text("heartbeat_intervall_s = 1\n")
    with pytest.raises(ConfigError, match="unknown key"):
        load_config({"node_id": "a", "listen": "tcp://127.0.0.1:1"}, tmp_path / "bad.toml")
    (tmp_path / "broken.toml").write_text("x = = 1\n")
    with pytest.raises(ConfigError, match="bad TOML"):
        load_config({}, tmp_path / "broken.toml")
    with pytest.raises(ConfigError, match="missing required"):
        load_config({"node_id": "a"})


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["start", "--listen", "tcp://127.0.0.1:7001"], "missing required setting 'node_id'"),
        (["start", "--id", "a", "--listen", "localhost:7001"], "invalid listen endpoint"),
        (["start", "--id", "bad id!", "--listen", "tcp://127.0.0.1:7001"], "invalid node id"),
        (
            ["start", "--id", "a", "--listen", "tcp://127.0.0.1:7001", "--heartbeat-interval", "x"],
            "is not a valid float",
        ),
        (
            ["start", "--id", "a", "--listen", "tcp://127.0.0.1:7001", "--failure-timeout", "0.1"],
            "failure_timeout_s",
        ),
        (
            [
                "start",
                "--id",
                "a",
                "--listen",
                "tcp://127.0.0.1:7001",
                "--config",
                "/nonexistent.toml",
            ],
            "cannot read config file",
        ),
        (["start", "--id", "a", "--listen", "tcp://127.0.0.1:7001", "--bogus"], "No such option"),
        (["link", "add", "bad id!"], "invalid PEER_ID"),
        (["status", "--connect", "nonsense"], "invalid --connect endpoint"),
        (["fault", "explode"], "Invalid value"),
    ],
)
def test_bad_cli_arguments(args: list[str], needle: str, tmp_path: Path) -> None:
    res = CliRunner().invoke(main, args, env={"CHAOS_DAEMON_DIR": str(tmp_path)})
    assert res.exit_code == 2, res.output
    assert needle in res.output


def test_client_commands_without_a_daemon(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["status"], env={"CHAOS_DAEMON_DIR": str(tmp_path)})
    assert res.exit_code == 1
    assert "no daemon listening" in res.output


def test_election_rules() -> None:
    cfg = _cfg()
    members = ["a", "b", "c"]
    e = Election("a", cfg, random.Random(1))
    rv = e.start(0.0, epoch=3)
    assert rv.term == 1 and e.role == Role.CANDIDATE
    assert not e.on_vote_reply(VoteReply(sender="b", term=1, granted=False), 0.0, members)
    assert e.on_vote_reply(VoteReply(sender="b", term=1, granted=True), 0.0, members)
    # one vote per term
    v = Election("c", cfg)
    assert v.on_request_vote(RequestVote(sender="a", epoch=3, term=1), 0.0, epoch=3).granted
    assert not v.on_request_vote(RequestVote(sender="b", epoch=3, term=1), 0.0, epoch=3).granted
    # a newer view refuses an older candidate
    assert not v.on_request_vote(RequestVote(sender="b", epoch=2, term=2), 0.0, epoch=3).granted
    # scheduler stickiness: a live scheduler is not deposed, except by a handover
    v.on_scheduler(5, "a", now=10.0)
    assert not v.on_request_vote(RequestVote(sender="b", epoch=3, term=6), 10.1, 3).granted
    assert v.term == 5
    assert v.on_request_vote(
        RequestVote(sender="b", epoch=3, term=6, transfer=True), 10.1, 3
    ).granted
    # a higher term in a reply makes a candidate step down
    e2 = Election("a", cfg)
    e2.start(0.0, 1)
    e2.on_vote_reply(VoteReply(sender="b", term=9, granted=False), 0.0, members)
    assert e2.role == Role.FOLLOWER and e2.term == 9


@pytest.fixture
def slow_daemon(tmp_path: Path) -> Iterator[tuple[zmq.Socket[bytes], DaemonClient]]:
    """A bare ROUTER playing the daemon on IPC, and a client of it that gives up after 0.3 s."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    daemon = ctx.socket(zmq.ROUTER)
    daemon.setsockopt(zmq.LINGER, 0)
    endpoint = f"ipc://{tmp_path}/d.ipc"
    daemon.bind(endpoint)
    client = DaemonClient(endpoint, timeout_s=0.3)
    try:
        yield daemon, client
    finally:
        client.close()
        daemon.close(linger=0)
        ctx.term()


def _answer_late(daemon: zmq.Socket[bytes], ident: bytes, late: Any,
                 own: Callable[[bytes], Any]) -> threading.Thread:  # fmt: skip
    """Once the client's next request is in: sends ``late`` (the answer to the request that
    timed out, which came from ``ident``), then ``own(request)``, that request's answer."""

    def run() -> None:
        if daemon.poll(5000):
            who, req = daemon.recv_multipart()
            daemon.send_multipart([ident, encode(late)])
            daemon.send_multipart([who, encode(own(req))])

    t = threading.Thread(target=run)
    t.start()
    return t


def test_a_late_answer_of_a_timed_out_request_is_not_taken_for_the_next_ones(
    slow_daemon: tuple[zmq.Socket[bytes], DaemonClient],
) -> None:
    """A request times out; its answer comes later, while the client waits for the answer to
    its next request of another kind. The client skips it (a trainer crashed on 'unexpected
    answer OpResult' when a report's late answer met its policy request)."""
    from chaos.errors import ChaosTimeout
    from chaos.protocol import OpResult, PolicyReply

    daemon, client = slow_daemon
    with pytest.raises(ChaosTimeout):
        client.op(LeaveCommand(sender="t"))  # the daemon is slow: no answer in time
    ident, _leave = daemon.recv_multipart()
    late = OpResult(sender="d", op_id="op1", ok=True)
    policy = PolicyReply(sender="d", epoch=9, term=1, members=["d"], sync=None)
    t = _answer_late(daemon, ident, late, lambda _req: policy)
    got = client.policy(timeout_s=5.0)
    t.join(10)
    assert got.epoch == 9


def test_a_late_answer_of_an_earlier_op_is_not_taken_for_the_next_op(
    slow_daemon: tuple[zmq.Socket[bytes], DaemonClient],
) -> None:
    """A trainer event times out; its answer (a refusal: the scheduler had evicted the trainer)
    comes while the client waits for its registration's answer, of the same kind (OpResult).
    The client tells them apart by op id (a soak's trainer crashed joining again on 'n18 has no
    registered trainer', the late answer of its failed-step report)."""
    from chaos.errors import ChaosTimeout
    from chaos.protocol import OpResult, Reason, StepFailed
    from chaos.protocol.codec import decode

    daemon, client = slow_daemon
    with pytest.raises(ChaosTimeout):  # the daemon is slow: no answer in time
        client.op(StepFailed(sender="t", detail="n2"))
    ident, raw = daemon.recv_multipart()
    first = decode(raw, 1 << 20)
    assert isinstance(first, StepFailed) and first.op_id  # the client named its op
    late = OpResult(sender="d", op_id=first.op_id, ok=False, reason=Reason.BAD_REQUEST,
                    detail="t has no registered trainer")  # fmt: skip
    seen: list[Any] = []

    def own(req: bytes) -> OpResult:  # the registration's own answer, under its op id
        seen.append(decode(req, 1 << 20))
        return msgspec.structs.replace(late, op_id=seen[0].op_id, ok=True, reason=None,
                                       detail="")  # fmt: skip

    t = _answer_late(daemon, ident, late, own)
    got = client.register_trainer("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", has_state=True,
                                  timeout_s=5.0)  # fmt: skip
    t.join(10)
    assert got.ok and got.op_id == seen[0].op_id != first.op_id


# -- the trainer events: one message type each ------------------------------------------------


def test_every_trainer_event_is_its_own_message_and_round_trips() -> None:
    """Each trainer event is a tagged message of its own (a tag no other message has); from the
    local trainer (no ``node_id``) and forwarded by a member (``node_id`` = sender), each one
    comes through ``validate`` as it was sent."""
    import typing

    from chaos.bench.fuzz_frames import trainer_event_examples
    from chaos.protocol import AnyTrainerEvent, Message, TrainerEventBase, kind_of, tag_of

    examples = trainer_event_examples()
    types = set(typing.get_args(AnyTrainerEvent))
    assert {type(e) for e in examples} == types and len(types) == 8
    assert types <= set(typing.get_args(Message))
    tags = [tag_of(e) for e in examples]
    every = [str(t.__struct_config__.tag) for t in typing.get_args(Message)]
    assert len(every) == len(set(every)) and set(tags) <= set(every)
    assert "trainer_event" not in every
    for msg in examples:
        assert isinstance(msg, TrainerEventBase)
        local = msgspec.structs.replace(msg, sender="", node_id=None)
        fwd = msgspec.structs.replace(msg, sender="b", node_id="b", epoch=5)
        for sent, kind in ((local, ("client", False)), (fwd, ("peer", True))):
            got = validate(encode(sent), CTX)
            assert not isinstance(got, Rejected), (tag_of(sent), got)
            assert got == sent and type(got) is type(sent) and kind_of(got) == kind


def test_a_wrong_shaped_trainer_event_is_refused_with_a_clear_error() -> None:
    """A field another event owns, a missing one, a bad value, the old one-message-with-a-kind
    shape, or a forwarded event whose ``node_id`` is not its sender: refused, saying why."""

    def detail(fields: dict[str, Any], ctx: ValidationContext = CTX) -> tuple[str, str]:
        got = validate(msgspec.msgpack.encode({"v": PROTOCOL_VERSION, **fields}), ctx)
        assert isinstance(got, Rejected), fields
        return got.refusal.reason.value, got.refusal.detail

    reason, why = detail({"type": "trainer_ready", "devices": ["b"]})  # NonfiniteStep's field
    assert reason == "malformed" and "unknown field `devices`" in why
    reason, why = detail({"type": "nonfinite_step", "step": 3, "pull": {}})  # PullDone's
    assert reason == "malformed" and "unknown field `pull`" in why
    reason, why = detail({"type": "trainer_progress", "op_id": "x"})  # one-way: no op id
    assert reason == "malformed" and "unknown field `op_id`" in why
    reason, why = detail({"type": "pull_done", "op_id": "x"})
    assert reason == "malformed" and "missing required field `pull`" in why
    reason, why = detail({"type": "step_failed", "elapsed_s": -1.0})
    assert reason == "malformed" and "elapsed_s" in why
    reason, why = detail({"type": "trainer_event", "kind": "ready"})  # protocol 10's shape
    assert reason == "malformed" and "trainer_event" in why
    reason, why = detail({"type": "trainer_gone", "sender": "b", "node_id": "a", "epoch": 5})
    assert reason == "bad_request" and "differs from the sender" in why
    reason, _ = detail({"type": "step_failed", "sender": "z", "node_id": "z", "epoch": 5})
    assert reason == "unknown_peer"  # forwarded: a member's message
    follower = ValidationContext(**{**CTX.__dict__, "is_scheduler": False})
    reason, _ = detail({"type": "trainer_throughput", "sender": "b", "node_id": "b",
                        "epoch": 5}, follower)  # fmt: skip
    assert reason == "not_scheduler"
