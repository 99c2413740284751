"""The frames ``chaos-bench fuzz`` sends: valid messages of every type, and their mutations.

:class:`Mutator` turns a valid message into a fuzz frame: byte-level mutations (bit flips,
truncation, insertion, deletion, overwrite) and field-level mutations (wrong types, huge
integers, deep nesting, strings that are not UTF-8, bad versions), random msgpack, random bytes
and oversized frames. :func:`trainer_frame` and :func:`lane_garbage` do the same for the
allreduce's binary frames and a lane listener's raw TCP. Everything draws from one seeded
random source, so a run can be repeated.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec

from chaos.protocol import messages as m
from chaos.wire import (
    FRAME_HEADER,
    FRAME_VERSION,
    LANE_HELLO,
    LANE_MAGIC,
    LANE_VERSION,
)

__all__ = [
    "DEEP", "Mutator", "control_examples", "frame_headers", "lane_garbage", "shard_examples",
    "trainer_event_examples", "trainer_frame",
]  # fmt: skip

DEEP = 3000
"""Nesting depth of the deep-nesting frames (past msgspec's recursion limit)."""


# ----------------------------------------------------------------------------- valid messages


def control_examples() -> list[m.Message]:
    """One well-formed instance of every control-plane message, most optional fields set."""
    tcp = "tcp://127.0.0.1:5000"
    view = m.ClusterView(
        epoch=3,
        term=2,
        scheduler="n1",
        nodes=[
            m.NodeInfo(
                id="n1",
                address=tcp,
                state=m.NodeState.ACTIVE,
                joined_at=1.0,
                neighbors=["n2"],
                resources=m.Resources(cpu_percent=1.0),
                data_address="tcp://127.0.0.1:5001",
            )
        ],
        links=[m.LinkInfo(a="n1", b="n2", bandwidth_bps=1e6, latency_s=0.001)],
    )
    sync = m.SyncPolicyWire(
        kind="tree",
        nodes=["n1", "n2"],
        root="n1",
        parents={"n1": None, "n2": "n1"},
        addresses={"n1": "tcp://127.0.0.1:5001"},
        topology_epoch=3,
    )
    repl = m.ReplicationWire(
        target="n2",
        shard_size=1024,
        assignment={"n1": [(0, 1024)]},
        donor_addresses={"n1": "tcp://127.0.0.1:5002"},
        donors=[m.DonorLink(id="n1", prop_s=0.001, trans_s_per_byte=1e-9)],
        tensor_sizes=[1024],
    )
    policy = m.PolicyReply(epoch=3, term=2, members=["n1", "n2"], sync=sync, replication=repl)
    return [
        m.SchedulerHeartbeat(sender="n1", epoch=3, term=2),
        m.MemberHeartbeat(sender="n2", epoch=3, term=2, resources=m.Resources()),
        m.RequestVote(sender="n2", epoch=3, term=4, transfer=True),
        m.VoteReply(sender="n1", epoch=3, term=4, granted=True),
        m.TimeoutNow(sender="n1", epoch=3, term=2),
        m.JoinRequest(
            sender="n3",
            node_id="n3",
            address=tcp,
            neighbors=["n1"],
            state_bytes=10,
            tensor_sizes=[4, 6],
            forwarded_by="n1",
            op_id="op",
        ),
        m.LeaveRequest(sender="n2", epoch=3, node_id="n2", op_id="op"),
        m.LinkRequest(sender="n2", epoch=3, a="n2", b="n1", op="connect", premeasured=True),
        m.ConnectCommand(sender="n1", epoch=3, term=2, peer="n2", address=tcp),
        m.LinkReport(
            sender="n2", epoch=3, term=2, peer="n1", up=True, latency_s=0.001, bandwidth_bps=1e9
        ),
        m.AgentReport(
            sender="n2",
            epoch=3,
            term=2,
            address=tcp,
            joined_at=1.0,
            links=[m.LinkInfo(a="n1", b="n2")],
            tensor_sizes=[8],
        ),
        m.ClusterUpdate(
            sender="n1",
            epoch=3,
            term=2,
            view=view,
            sync=sync,
            replication=repl,
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
            nodes=view.nodes,
            links=view.links,
            sync=sync,
            notes=["x"],
        ),
        m.DoctorRequest(),
        m.DoctorReply(checks=[m.DoctorCheck(name="links", status="warn", detail="d", fix="f")]),
        m.LeaveCommand(),
        m.LinkCommand(peer="n2", op="disconnect"),
        m.FaultCommand(name="drop_to", peers=["n2"]),
        m.FaultReply(active=["drop_to n2"]),
        m.PolicyRequest(),
        policy,
        m.PolicyNotice(epoch=3, paused=True, interval_s=1.0, policy=policy),
        m.TrainerRegister(
            data_address=tcp,
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
            data_address=tcp,
            shard_address=tcp,
            has_state=False,
            tensor_sizes=[16],
        ),
        *trainer_event_examples(),
    ]


def trainer_event_examples() -> list[m.Message]:
    """One well-formed instance of every trainer event, most fields set (the local trainer's
    and, with ``node_id``, a member's forwarded one)."""
    pull = m.PullReport(
        reason="donor n3 failed",
        per_shard_cost_s=0.01,
        replans=1,
        state_bytes=64,
        donors=[m.DonorPull(id="n1", bytes=64, shards=2, elapsed_s=0.5, ranges=[(0, 64)])],
    )
    return [
        m.TrainerReady(node_id=None, elapsed_s=1.0, detail="pulled", step=4, op_id="r1"),
        m.TrainerGone(sender="n2", node_id="n2", detail="pid 12 exited", op_id="g1"),
        m.PullDone(op_id="p1", pull=pull),
        m.StepFailed(sender="n2", epoch=2, node_id="n2", elapsed_s=3.0, detail="n1", op_id="f1"),
        m.CaughtUp(detail="step 9, 1 behind", op_id="c1"),
        m.TrainerProgress(
            step=7,
            in_step=True,
            elapsed_s=0.5,
            silent_s=0.1,
            samples_per_s=120.0,
            global_batch=64,
            audit=m.AuditInfo(step=6, audits=2),
            pulling=m.PullStatus(pulled_bytes=32, total_bytes=64, donors={"n1": 32}),
            phase=m.TrainerPhase.LIVE,
        ),
        m.NonfiniteStep(sender="n2", node_id="n2", step=7, devices=["n3"]),
        m.TrainerThroughput(sender="n2", node_id="n2", samples_per_s=120.0, global_batch=64),
    ]


def shard_examples() -> list[Any]:
    from chaos.replication import wire

    return [
        wire.ManifestRequest(req_id=1, epoch=1),
        wire.ManifestRequest(req_id=2, epoch=1, step=0, newer_ok=True),
        wire.ShardRequest(
            req_id=3,
            epoch=1,
            step=0,
            fingerprint="ab" * 32,
            digest="cd" * 32,
            offset=0,
            length=64,
        ),
        wire.StepLogRequest(req_id=4, from_step=0, max_entries=8),
        wire.ManifestReply(req_id=1, epoch=1, step=0, digest="cd" * 32),
        wire.ShardReply(req_id=3, epoch=1, step=0, offset=0, length=64, checksum=2**64 - 1),
        wire.refusal(3, m.Reason.OUT_OF_RANGE, "past the end"),
    ]


def frame_headers() -> list[bytes]:
    """A valid allreduce header of every op (dtype float32, key ``(1, 5)``)."""
    return [FRAME_HEADER.pack(FRAME_VERSION, op, 1, 0, 0, 1, 5, 0, 16) for op in range(1, 10)]


# ----------------------------------------------------------------------------- mutations

_HUGE = [2**64 - 1, 2**63, 2**63 - 1, 2**53, -(2**63), -1, 2**32, 2**32 - 1]
_BAD_VERSIONS: list[Any] = [0, 1, 2, 4, 255, -1, 2**64 - 1, "3", 3.0, None, [3]]


class Mutator:
    """Frame generators over one seeded random source.

    Args:
        rng: The random source (seeded: a run can be repeated).
    """

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self._deep = b"\x91" * DEEP + b"\xc0"

    def random_bytes(self, max_len: int = 512) -> bytes:
        """Uniformly random bytes."""
        return self.rng.randbytes(self.rng.randint(0, max_len))

    def value(self, depth: int = 0) -> Any:
        """A random msgpack value (scalars, lists, maps; huge integers favoured)."""
        r = self.rng.random()
        if depth < 3 and r < 0.15:
            return [self.value(depth + 1) for _ in range(self.rng.randint(0, 4))]
        if depth < 3 and r < 0.3:
            return {self.text(8): self.value(depth + 1) for _ in range(self.rng.randint(0, 4))}
        return self.rng.choice(
            [
                None,
                self.rng.random() < 0.5,
                self.rng.choice(_HUGE),
                self.rng.randint(-(2**63), 2**64 - 1),
                self.rng.randint(-5, 5),
                self.rng.choice([float("nan"), float("inf"), -0.0, 1e308, self.rng.random()]),
                self.text(24),
                self.rng.randbytes(self.rng.randint(0, 32)),
            ]
        )

    def text(self, max_len: int) -> str:
        """A random string (any code point but surrogates)."""
        n = self.rng.randint(0, max_len)
        return "".join(
            chr(self.rng.choice([self.rng.randint(32, 126), self.rng.randint(0xA0, 0xD7FF)]))
            for _ in range(n)
        )

    def bytes_mutation(self, valid: bytes) -> bytes:
        """``valid`` after one to four byte-level mutations."""
        data = bytearray(valid)
        for _ in range(self.rng.randint(1, 4)):
            i = self.rng.randint(0, len(data))
            op = self.rng.randrange(5)
            if op == 0 and data:
                j = min(i, len(data) - 1)
                data[j] ^= 1 << self.rng.randrange(8)
            elif op == 1:
                del data[i:]
            elif op == 2:
                data[i:i] = self.rng.randbytes(self.rng.randint(1, 16))
            elif op == 3:
                del data[i : i + self.rng.randint(1, 16)]
            else:
                extra = self.rng.randbytes(self.rng.randint(1, 8))
                data[i : i + len(extra)] = extra
        return bytes(data)

    def field_mutation(self, valid: dict[str, Any]) -> bytes:
        """``valid`` with one to three fields replaced by wrong values, removed or added."""
        data = dict(valid)
        keys = [*data, "type", "v", "extra"]
        for _ in range(self.rng.randint(1, 3)):
            key = self.rng.choice(keys)
            if key in data and self.rng.random() < 0.25:
                del data[key]
            else:
                data[key] = self.value()
        return msgspec.msgpack.encode(data)

    def bad_version(self, valid: dict[str, Any]) -> bytes:
        """``valid`` with another ``v``."""
        return msgspec.msgpack.encode({**valid, "v": self.rng.choice(_BAD_VERSIONS)})

    def huge_int(self, valid: dict[str, Any]) -> bytes:
        """``valid`` with one integer field (or a new one) at a fixed width's edge."""
        ints = [k for k, v in valid.items() if isinstance(v, int) and not isinstance(v, bool)]
        key = self.rng.choice(ints or ["epoch"])
        return msgspec.msgpack.encode({**valid, key: self.rng.choice(_HUGE)})

    def not_utf8(self, valid: dict[str, Any]) -> bytes:
        """``valid`` with one string field (or the tag) made of a byte that is not UTF-8."""
        strs = [k for k, v in valid.items() if isinstance(v, str)] or ["type"]
        key = self.rng.choice(strs)
        marker = "\x7f" * 3
        raw = msgspec.msgpack.encode({**valid, key: marker})
        return raw.replace(b"\xa3" + marker.encode(), b"\xa3\x80\xff\xc0", 1)

    def deep(self, valid: dict[str, Any]) -> bytes:
        """``valid`` with a field (known or unknown) nested :data:`DEEP` arrays deep, or a map
        nested as deep."""
        if self.rng.random() < 0.2:
            return b"\x81\xa1x" * DEEP + b"\xc0"
        key = self.rng.choice([*valid, "extra"])
        rest = {k: v for k, v in valid.items() if k != key}
        head = msgspec.msgpack.encode(rest)
        body = head[1:] if len(rest) < 16 else head[3:]
        n = len(rest) + 1
        prefix = bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")
        return prefix + body + msgspec.msgpack.encode(key) + self._deep

    def oversized(self, valid: dict[str, Any], limit: int) -> bytes:
        """``valid`` padded past ``limit`` bytes."""
        return msgspec.msgpack.encode({**valid, "extra": b"\x00" * (limit + 1)})

    def msgpack_frame(self, valid: bytes, fields: dict[str, Any], limit: int) -> tuple[str, bytes]:
        """One fuzz frame built from a valid msgpack message; returns ``(kind, frame)``."""
        r = self.rng.random()
        if r < 0.30:
            return "byte_mutation", self.bytes_mutation(valid)
        if r < 0.55:
            return "field_mutation", self.field_mutation(fields)
        if r < 0.62:
            return "bad_version", self.bad_version(fields)
        if r < 0.70:
            return "huge_int", self.huge_int(fields)
        if r < 0.76:
            return "not_utf8", self.not_utf8(fields)
        if r < 0.81:
            return "deep_nesting", self.deep(fields)
        if r < 0.88:
            return "random_msgpack", msgspec.msgpack.encode(self.value())
        if r < 0.995:
            return "random_bytes", self.random_bytes()
        return "oversized", self.oversized(fields, limit)


def lane_garbage(mut: Mutator, rng: random.Random) -> tuple[str, bytes]:
    """Bytes for one raw TCP connection to a lane listener."""
    hello = LANE_HELLO.pack(LANE_MAGIC, LANE_VERSION, rng.getrandbits(64), 1) + b"b"
    r = rng.random()
    if r < 0.4:
        return "lane_hello_mutation", mut.bytes_mutation(hello)
    if r < 0.6:
        n = rng.randint(0, 255)
        raw = LANE_HELLO.pack(LANE_MAGIC, LANE_VERSION, rng.getrandbits(64), n)
        return "lane_hello_fields", raw + rng.randbytes(rng.randint(0, n + 8))
    if r < 0.8:
        return "lane_hello_then_frames", hello + rng.randbytes(rng.randint(0, 4096))
    return "lane_random_bytes", mut.random_bytes(300)


def trainer_frame(
    mut: Mutator, rng: random.Random, headers: list[bytes]
) -> tuple[str, list[bytes]]:
    """Parts of one message to the allreduce ROUTER."""
    head = rng.choice(headers)
    r = rng.random()
    if r < 0.35:
        return "header_mutation", [mut.bytes_mutation(head), rng.randbytes(64)]
    if r < 0.5:
        fields = list(FRAME_HEADER.unpack(head))
        i = rng.randrange(len(fields))
        width = FRAME_HEADER.format[1 + i]
        top = {"B": 2**8, "I": 2**32, "Q": 2**64}[width]
        fields[i] = rng.choice([0, top - 1, rng.randrange(top)])
        return "header_fields", [FRAME_HEADER.pack(*fields), rng.randbytes(rng.randint(0, 128))]
    if r < 0.6:
        fields = list(FRAME_HEADER.unpack(head))
        fields[0] = rng.choice([0, 1, 3, 255])
        return "bad_version", [FRAME_HEADER.pack(*fields), b""]
    if r < 0.7:
        return "bad_lane_offer", [
            FRAME_HEADER.pack(FRAME_VERSION, 9, 1, 0, 0, 1, 5, 0, 0),
            mut.random_bytes(16),
        ]
    if r < 0.8:
        return "multipart", [mut.random_bytes(40) for _ in range(rng.choice([1, 2, 4, 5]))]
    if r < 0.995:
        return "random_bytes", [mut.random_bytes(64), mut.random_bytes(256)]
    return "oversized", [head, b"\x00" * (2 << 20)]
