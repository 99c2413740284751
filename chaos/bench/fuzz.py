"""``chaos-bench fuzz``: random and mutated frames at live processes on loopback.

Three real processes are started, each a target:

* ``daemon``: a ``chaos-daemon start`` (a cluster of one, no cluster key), fuzzed on its TCP
  endpoint and on its IPC endpoint;
* ``shard_server``: a donor's :class:`~chaos.replication.server.ShardServer` serving a small
  published training state (``python -m chaos.bench.fuzz shard``);
* ``trainer``: the data plane of a trainer: two :class:`~chaos.collectives.Communicator` members
  in one process allreducing in a ring without pause, with payload lanes
  (``python -m chaos.bench.fuzz trainer``); member ``a``'s allreduce ROUTER and lane listener
  are fuzzed.

Each target gets ``--frames`` frames: byte-level mutations (bit flips, truncation, insertion,
deletion, overwrite) and field-level mutations (wrong types, huge integers, deep nesting, strings
that are not UTF-8, bad versions) of a valid message of every type its decoder knows, random
msgpack, random bytes, oversized frames and odd multipart counts; a fifth of the trainer's go to
its lane port as raw TCP (mutated and random hellos, garbage after a valid-looking hello).

Afterwards every target must still answer a valid request (the daemon a ``status``, the shard
server a manifest request, the trainer's members another allreduce round and a TCP connection
at both of its ports). Reported per target: whether it crashed (died or stopped answering; goal
0), the refusals that came back by reason code, its RSS before and after (goal: within 10 %),
and the frames sent per second.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import msgspec
import psutil
import zmq

from chaos.errors import ChaosError, ProtocolError
from chaos.launch import (
    daemon_command,
    free_tcp_address,
    kill_and_reap,
    spawn_daemon,
    spawn_worker,
    wait_until,
)
from chaos.protocol import codec
from chaos.protocol import messages as m
from chaos.wire import (
    FRAME_HEADER,
    FRAME_VERSION,
    LANE_HELLO,
    LANE_MAGIC,
    LANE_VERSION,
)

__all__ = ["FuzzTarget", "control_examples", "fuzz_command", "run_fuzz"]

START_TIMEOUT_S = 60.0
"""Longest wait for a target to come up."""
ANSWER_TIMEOUT_S = 5.0
"""Longest wait for a target's answer to the valid request after the run."""
SEND_TIMEOUT_S = 5.0
"""Longest wait for one send (a target that stops reading fills the queue)."""
DRAIN_QUIET_S = 1.0
"""After the last frame, replies are collected until none came for this long..."""
DRAIN_MAX_S = 15.0
"""... or for at most this long."""
SETTLE_S = 1.0
"""Pause before the RSS after the run is read (the target frees what the last frames held)."""
RSS_TOLERANCE = 0.10
"""An RSS after the run within this fraction of the one before counts as back."""
LAST_FRAMES = 32
"""Frames kept per target, reported (hex) when the target crashed."""
LANE_SHARE = 0.2
"""Share of the trainer's frames sent to its lane port as raw TCP."""
DEEP = 3000
"""Nesting depth of the deep-nesting frames (past msgspec's recursion limit)."""

_NOT_LEAVING = (m.LeaveCommand, m.FaultCommand)
"""Well-formed client commands that would make the daemon leave or cut its links: legitimate
behaviour, not bad input; a mutation that decodes to one is not sent."""


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
        m.TrainerEvent(kind="ready", node_id=None, elapsed_s=1.0),
    ]


def _shard_examples() -> list[Any]:
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
        wire.ManifestReply(req_id=1, epoch=1, step=0, digest="cd" * 32),
        wire.ShardReply(req_id=3, epoch=1, step=0, offset=0, length=64, checksum=2**64 - 1),
        wire.refusal(3, m.Reason.OUT_OF_RANGE, "past the end"),
    ]


def _frame_headers() -> list[bytes]:
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


# ----------------------------------------------------------------------------- targets


def _rss(pid: int) -> int:
    """Resident set size of ``pid`` in bytes (0 when it is gone)."""
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return 0


def _dealer(
    ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, ident: bytes | None = None
) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, int(SEND_TIMEOUT_S * 1000))
    sock.setsockopt(zmq.RCVHWM, 0)
    if ident is not None:
        sock.setsockopt(zmq.ROUTING_ID, ident)
    sock.connect(endpoint)
    return sock


def _tcp_open(endpoint_or_host: str, port: int | None = None) -> bool:
    """Whether a TCP connection to ``tcp://HOST:PORT`` (or ``HOST``, ``port``) is accepted."""
    if port is None:
        host, _, p = endpoint_or_host.removeprefix("tcp://").rpartition(":")
        port = int(p)
    else:
        host = endpoint_or_host
    try:
        with socket.create_connection((host, port), timeout=ANSWER_TIMEOUT_S):
            return True
    except OSError:
        return False


@dataclass
class FuzzTarget:
    """One target's figures.

    Attributes:
        name: ``daemon``, ``shard_server`` or ``trainer``.
        pid: Its process id.
        sent: Frames sent.
        send_s: Seconds spent sending (replies drained on the way).
        kinds: Frames sent, by kind of mutation.
        refusals: Refusals that came back, by reason code.
        replies: Other replies that came back, by type.
        send_timeouts: Sends that did not leave within :data:`SEND_TIMEOUT_S`.
        rss_before: RSS before the run, bytes.
        rss_after: RSS after the run, bytes.
        alive: The process was alive after the run.
        answers: It answered the valid request after the run.
        crashed_at: Frames sent when it was first found dead (``None``: never).
        last_frames: The last frames sent (hex, multipart joined by ``|``), when it crashed.
        extra: Target-specific figures.
    """

    name: str
    pid: int = 0
    sent: int = 0
    send_s: float = 0.0
    kinds: Counter[str] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)
    replies: Counter[str] = field(default_factory=Counter)
    send_timeouts: int = 0
    rss_before: int = 0
    rss_after: int = 0
    alive: bool = False
    answers: bool = False
    crashed_at: int | None = None
    last_frames: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def crashed(self) -> bool:
        """It died or stopped answering."""
        return not (self.alive and self.answers) or self.crashed_at is not None

    def to_json(self) -> dict[str, Any]:
        """The JSON record of this target."""
        ratio = self.rss_after / self.rss_before if self.rss_before else None
        return {
            "pid": self.pid,
            "crashed": self.crashed,
            "alive": self.alive,
            "answers": self.answers,
            "crashed_at_frame": self.crashed_at,
            "frames_sent": self.sent,
            "send_s": round(self.send_s, 4),
            "frames_per_s": round(self.sent / self.send_s, 1) if self.send_s > 0 else None,
            "frames_by_kind": dict(sorted(self.kinds.items())),
            "refusals": dict(sorted(self.refusals.items())),
            "replies": dict(sorted(self.replies.items())),
            "send_timeouts": self.send_timeouts,
            "rss_before_bytes": self.rss_before,
            "rss_after_bytes": self.rss_after,
            "rss_ratio": round(ratio, 4) if ratio is not None else None,
            "rss_within_10pct": ratio is not None and abs(ratio - 1.0) <= RSS_TOLERANCE,
            "last_frames_hex": self.last_frames if self.crashed else [],
            **self.extra,
        }


class _Sender:
    """Sends a target's frames, drains its replies, and watches its process."""

    def __init__(
        self,
        target: FuzzTarget,
        proc: subprocess.Popen[Any],
        decode: Callable[[bytes], Any],
        header: int = -1,
    ) -> None:
        self.t = target
        self.proc = proc
        self.decode = decode
        self.header = header  # which part of a reply holds the message
        self.last: deque[str] = deque(maxlen=LAST_FRAMES)

    def send(self, sock: zmq.Socket[bytes], kind: str, parts: list[bytes]) -> None:
        self.last.append("|".join(p.hex() for p in parts))
        self.t.kinds[kind] += 1
        self.t.sent += 1
        try:
            sock.send_multipart(parts)
        except zmq.Again:
            self.t.send_timeouts += 1
        self.drain(sock)
        if self.t.sent % 200 == 0:
            self.check_alive()

    def drain(self, sock: zmq.Socket[bytes]) -> int:
        n = 0
        while sock.poll(0, zmq.POLLIN):
            self.count(sock.recv_multipart(zmq.NOBLOCK)[self.header])
            n += 1
        return n

    def drain_quiet(self, socks: list[zmq.Socket[bytes]]) -> None:
        """Collects replies until none came for :data:`DRAIN_QUIET_S` (at most
        :data:`DRAIN_MAX_S`)."""
        end = time.monotonic() + DRAIN_MAX_S
        quiet_until = time.monotonic() + DRAIN_QUIET_S
        while time.monotonic() < min(end, quiet_until):
            got = sum(self.drain(s) for s in socks)
            if got:
                quiet_until = time.monotonic() + DRAIN_QUIET_S
            else:
                time.sleep(0.01)

    def count(self, raw: bytes) -> None:
        try:
            msg = self.decode(raw)
        except (ProtocolError, msgspec.DecodeError) as exc:
            self.t.replies["undecodable"] += 1
            samples = self.t.extra.setdefault("undecodable_replies", [])
            if len(samples) < 3:  # a reply the target's own client could not read
                samples.append({"hex": raw[:512].hex(), "error": str(exc)[:200]})
            return
        if isinstance(msg, m.Refusal):
            self.t.refusals[msg.reason.value] += 1
        else:
            self.t.replies[type(msg).__name__] += 1

    def check_alive(self) -> None:
        if self.t.crashed_at is None and self.proc.poll() is not None:
            self.t.crashed_at = self.t.sent
            self.t.last_frames = list(self.last)


def _fuzz_daemon(
    root: Path, n: int, rng: random.Random, procs: list[subprocess.Popen[Any]]
) -> FuzzTarget:
    from chaos.daemon.client import DaemonClient
    from chaos.daemon.config import ipc_endpoint_for

    t = FuzzTarget("daemon")
    run_dir = root / "daemon"
    addr = free_tcp_address()
    proc = spawn_daemon(daemon_command("fuzz-target", addr), run_dir, log_level="ERROR")
    procs.append(proc)
    t.pid = proc.pid

    def status_ok() -> bool:
        with DaemonClient(addr, timeout_s=ANSWER_TIMEOUT_S) as c:
            return isinstance(c.status(), m.StatusReply)

    wait_until(
        status_ok,
        START_TIMEOUT_S,
        "the daemon to answer",
        tolerate=(ChaosError, OSError),
        watch={"daemon": proc},
    )
    examples = control_examples()
    frames = [codec.encode(x) for x in examples]
    maps = [msgspec.msgpack.decode(f) for f in frames]
    mut = Mutator(rng)
    sender = _Sender(t, proc, lambda raw: codec.decode(raw, 1 << 24))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socks = [_dealer(ctx, addr), _dealer(ctx, ipc_endpoint_for(str(run_dir)))]
    try:
        time.sleep(0.2)
        t.rss_before = _rss(proc.pid)
        start = time.perf_counter()
        for i in range(n):
            k = rng.randrange(len(frames))
            kind, frame = mut.msgpack_frame(frames[k], maps[k], m.DEFAULT_MAX_FRAME_BYTES)
            with contextlib.suppress(ProtocolError):
                if isinstance(codec.decode(frame, 1 << 24), _NOT_LEAVING):
                    kind, frame = "random_bytes", mut.random_bytes()
            parts = [frame]
            r = rng.random()
            if r < 0.03:
                parts.append(mut.random_bytes(64))  # an attachment
                kind = "attachment"
            elif r < 0.05:
                parts = [frame] * rng.randint(3, 5)
                kind = "multipart"
            elif r < 0.06:
                parts = [b""]
                kind = "empty"
            sender.send(socks[i % 2], kind, parts)
        t.send_s = time.perf_counter() - start
        sender.drain_quiet(socks)
        sender.check_alive()
        time.sleep(SETTLE_S)
        t.rss_after = _rss(proc.pid)
        t.alive = proc.poll() is None
        try:
            t.answers = status_ok()
        except (ChaosError, OSError):
            t.answers = False
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()
    return t


def _child(
    role: str, root: Path, procs: list[subprocess.Popen[Any]]
) -> tuple[subprocess.Popen[Any], dict[str, Any], Path]:
    """Starts ``python -m chaos.bench.fuzz ROLE`` and waits for its ready file."""
    ready = root / f"{role}.ready.json"
    stats = root / f"{role}.stats.json"
    argv = [
        sys.executable,
        "-m",
        "chaos.bench.fuzz",
        role,
        "--ready",
        str(ready),
        "--stats",
        str(stats),
    ]
    proc = spawn_worker(argv, log_path=root / f"{role}.log", term_on_parent_death=True)
    procs.append(proc)

    def up() -> dict[str, Any]:
        data: dict[str, Any] = json.loads(ready.read_text()) if ready.exists() else {}
        return data

    what = f"the {role} target to start"
    info = wait_until(up, START_TIMEOUT_S, what, watch={role: proc}, tolerate=(ValueError,))
    return proc, info, stats


def _fuzz_shard_server(
    root: Path, n: int, rng: random.Random, procs: list[subprocess.Popen[Any]]
) -> FuzzTarget:
    from chaos.replication import wire

    t = FuzzTarget("shard_server")
    proc, info, _ = _child("shard", root, procs)
    t.pid = proc.pid
    examples = _shard_examples()
    frames = [wire.WIRE_ENCODER.encode(x) for x in examples]
    maps = [msgspec.msgpack.decode(f) for f in frames]
    mut = Mutator(rng)
    sender = _Sender(t, proc, wire.REPLY_DECODER.decode, header=0)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = _dealer(ctx, info["address"])

    def manifest_ok() -> bool:
        with contextlib.closing(_dealer(ctx, info["address"])) as s:
            s.send(wire.WIRE_ENCODER.encode(wire.ManifestRequest(req_id=7, epoch=info["epoch"])))
            if not s.poll(int(ANSWER_TIMEOUT_S * 1000)):
                return False
            head = wire.REPLY_DECODER.decode(s.recv_multipart()[0])
            return isinstance(head, wire.ManifestReply) and head.req_id == 7

    try:
        if not manifest_ok():
            raise ChaosError("the shard server did not answer its first manifest request")
        t.rss_before = _rss(proc.pid)
        start = time.perf_counter()
        for _ in range(n):
            k = rng.randrange(len(frames))
            kind, frame = mut.msgpack_frame(frames[k], maps[k], wire.MAX_REQUEST_BYTES)
            parts = [frame]
            if rng.random() < 0.03:
                parts = [frame] * rng.randint(2, 4)
                kind = "multipart"
            sender.send(sock, kind, parts)
        t.send_s = time.perf_counter() - start
        sender.drain_quiet([sock])
        sender.check_alive()
        time.sleep(SETTLE_S)
        t.rss_after = _rss(proc.pid)
        t.alive = proc.poll() is None
        t.answers = t.alive and manifest_ok()
    finally:
        sock.close(linger=0)
        ctx.term()
    return t


def _lane_garbage(mut: Mutator, rng: random.Random) -> tuple[str, bytes]:
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


def _trainer_frame(
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


def _read_stats(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    except (OSError, ValueError):
        return {}


def _fuzz_trainer(
    root: Path, n: int, rng: random.Random, procs: list[subprocess.Popen[Any]]
) -> FuzzTarget:
    t = FuzzTarget("trainer")
    proc, info, stats_path = _child("trainer", root, procs)
    t.pid = proc.pid
    mut = Mutator(rng)
    headers = _frame_headers()
    sender = _Sender(t, proc, lambda raw: None)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socks = [
        _dealer(ctx, info["address"], b"fuzz"),
        _dealer(ctx, info["address"]),
        _dealer(ctx, info["address"], b"b"),
    ]
    lane_port = int(info["lane_port"])
    lane_refused = 0
    try:
        before = _read_stats(stats_path)
        t.rss_before = _rss(proc.pid)
        start = time.perf_counter()
        for i in range(n):
            if rng.random() < LANE_SHARE:
                kind, raw = _lane_garbage(mut, rng)
                sender.last.append("tcp:" + raw.hex())
                t.kinds[kind] += 1
                t.sent += 1
                try:
                    with socket.create_connection(
                        ("127.0.0.1", lane_port), timeout=SEND_TIMEOUT_S
                    ) as c:
                        c.sendall(raw)
                except OSError:
                    lane_refused += 1
                if t.sent % 200 == 0:
                    sender.check_alive()
                continue
            kind, parts = _trainer_frame(mut, rng, headers)
            sender.send(socks[i % len(socks)], kind, parts)
        t.send_s = time.perf_counter() - start
        sender.check_alive()
        time.sleep(SETTLE_S)
        t.rss_after = _rss(proc.pid)
        rounds = int(_read_stats(stats_path).get("rounds", 0))

        def progressed() -> bool:
            return int(_read_stats(stats_path).get("rounds", 0)) > rounds

        t.alive = proc.poll() is None
        try:
            wait_until(
                progressed, 2 * ANSWER_TIMEOUT_S, "another allreduce round", watch={"trainer": proc}
            )
            still = True
        except ChaosError:
            still = False
        t.alive = proc.poll() is None
        t.answers = still and _tcp_open(info["address"]) and _tcp_open("127.0.0.1", lane_port)
        after = _read_stats(stats_path)
        t.extra = {
            "lane_connections_refused": lane_refused,
            "rounds_during_run": int(after.get("rounds", 0)) - int(before.get("rounds", 0)),
            "round_failures_during_run": int(after.get("failures", 0))
            - int(before.get("failures", 0)),
            "last_round_error": after.get("last_error"),
            "member_a": {
                k: int(after.get("a", {}).get(k, 0)) - int(before.get("a", {}).get(k, 0))
                for k in after.get("a", {})
            },
        }
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()
    return t


TARGETS: dict[
    str, Callable[[Path, int, random.Random, list[subprocess.Popen[Any]]], FuzzTarget]
] = {
    "daemon": _fuzz_daemon,
    "shard_server": _fuzz_shard_server,
    "trainer": _fuzz_trainer,
}


def run_fuzz(frames: int, seed: int, targets: tuple[str, ...] = tuple(TARGETS)) -> dict[str, Any]:
    """Starts every target, fuzzes it with ``frames`` frames, and checks it afterwards.

    Args:
        frames: Frames per target.
        seed: Seed of the random source (a run is repeatable up to timing).
        targets: The targets to run (default all).

    Returns:
        The JSON record (see the module docstring).

    Raises:
        ChaosTimeout: a target did not start within :data:`START_TIMEOUT_S`.
        ProcessExited: a target exited while it started.
    """
    results: dict[str, Any] = {}
    daemons: list[subprocess.Popen[Any]] = []
    workers: list[subprocess.Popen[Any]] = []  # process-group leaders (spawn_worker)
    total_sent, total_s = 0, 0.0
    with tempfile.TemporaryDirectory(prefix="chaos-bench-fuzz-") as tmp:
        try:
            for name in targets:
                rng = random.Random(f"{seed}:{name}")
                procs = daemons if name == "daemon" else workers
                t = TARGETS[name](Path(tmp), frames, rng, procs)
                results[name] = t.to_json()
                total_sent += t.sent
                total_s += t.send_s
        finally:
            kill_and_reap(daemons, timeout_s=10.0)
            kill_and_reap(workers, group=True, timeout_s=10.0)
    procs = daemons + workers
    return {
        "frames_per_target": frames,
        "seed": seed,
        "crashes": sum(1 for r in results.values() if r["crashed"]),
        "frames_sent": total_sent,
        "frames_per_s": round(total_sent / total_s, 1) if total_s > 0 else None,
        "targets": results,
        "reaped": all(p.poll() is not None for p in procs),
    }


def _print_result(result: dict[str, Any]) -> None:
    mib = 1 << 20
    click.echo(
        f"{'target':<14}{'sent':>8}{'frames/s':>10}{'crashed':>9}{'RSS before':>12}"
        f"{'after':>9}{'ratio':>7}"
    )
    for name, r in result["targets"].items():
        click.echo(
            f"{name:<14}{r['frames_sent']:>8}{r['frames_per_s'] or 0:>10.0f}"
            f"{'YES' if r['crashed'] else 'no':>9}{r['rss_before_bytes'] / mib:>10.1f}Mi"
            f"{r['rss_after_bytes'] / mib:>7.1f}Mi{r['rss_ratio'] or 0:>7.3f}"
        )
    for name, r in result["targets"].items():
        if r["refusals"]:
            reasons = ", ".join(f"{k} {v}" for k, v in r["refusals"].items())
            click.echo(f"{name} refusals: {reasons}")
        if r["crashed"]:
            click.echo(f"{name} CRASHED at frame {r['crashed_at_frame']}; last frames in the JSON")
    click.echo(
        f"crashes: {result['crashes']} (goal 0); {result['frames_sent']} frames at "
        f"{result['frames_per_s'] or 0:.0f} frames/s"
    )


@click.command("fuzz")
@click.option(
    "--frames",
    type=click.IntRange(min=1),
    required=True,
    help="Frames sent at each target (a positive integer).",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False),
    required=True,
    help="Write the figures here.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the frames.")
def fuzz_command(frames: int, json_path: str, seed: int) -> None:
    """Random and mutated frames at a live daemon, shard server and trainer on loopback."""
    result = run_fuzz(frames, seed)
    Path(json_path).write_text(json.dumps(result, indent=2))
    _print_result(result)
    click.echo(f"wrote {json_path}")


# ----------------------------------------------------------------------------- target processes


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def _serve_shards(ready: Path, stop: threading.Event) -> None:
    """The shard-server target: serves a small published state until ``stop``."""
    import torch

    from chaos.replication.server import ShardServer
    from chaos.replication.state import TrainingState

    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    with ShardServer() as server:
        server.publish(TrainingState.capture(model, opt, step=0, epoch=1), epoch=1, step=0)
        _write_json(ready, {"address": server.address, "epoch": 1, "pid": os.getpid()})
        while not stop.wait(0.5):
            pass


def _train(ready: Path, stats: Path, stop: threading.Event) -> None:
    """The trainer target: two members allreduce in a ring until ``stop``; member ``a``'s stats
    go to ``stats`` twice a second."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from chaos.collectives import Communicator, CommunicatorConfig, Topology

    def member(node_id: str) -> Communicator:
        cfg = CommunicatorConfig(
            node_id=node_id, chunk_bytes=1 << 16, timeout_s=10.0, lane_min_bytes=0
        )
        return Communicator(cfg)

    a, b = member("a"), member("b")
    epoch, rounds, failures, last_error = 1, 0, 0, None
    x = torch.ones(1 << 16)

    def install() -> None:
        topo = Topology(
            "ring", ("a", "b"), {"a": a.address, "b": b.address}, epoch, ring_order=("a", "b")
        )
        a.update_topology(topo)
        b.update_topology(topo)

    install()
    next_write = 0.0
    with ThreadPoolExecutor(2) as pool:
        try:
            while not stop.is_set():
                futs = [pool.submit(c.allreduce, x, "sum") for c in (a, b)]
                errors = [f.exception(timeout=60.0) for f in futs]
                if any(errors):
                    failures += 1
                    last_error = repr(next(e for e in errors if e))[:300]
                    epoch += 1
                    install()
                else:
                    rounds += 1
                now = time.monotonic()
                if now >= next_write or rounds == 1:
                    next_write = now + 0.5
                    st = a.stats
                    figures = {k: v for k, v in vars(st).items() if isinstance(v, int)}
                    _write_json(
                        stats,
                        {
                            "rounds": rounds,
                            "failures": failures,
                            "last_error": last_error,
                            "a": figures,
                        },
                    )
                    if not ready.exists():
                        # the lane listener opens at the first round; the switch exposes it
                        # for inspection (the bench fuzzes member a's port)
                        lanes = getattr(getattr(a, "_lanes", None), "lanes", None)
                        port = getattr(lanes, "port", None)
                        if port is not None:
                            _write_json(
                                ready, {"address": a.address, "lane_port": port, "pid": os.getpid()}
                            )
        finally:
            a.close()
            b.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m chaos.bench.fuzz {shard,trainer}``: runs one target process until it is
    killed (the bench reaps it; it gets SIGTERM when the bench dies)."""
    ap = argparse.ArgumentParser(prog="python -m chaos.bench.fuzz")
    ap.add_argument("role", choices=["shard", "trainer"])
    ap.add_argument("--ready", type=Path, required=True)
    ap.add_argument("--stats", type=Path, required=True)
    args = ap.parse_args(argv)
    stop = threading.Event()
    if args.role == "shard":
        _serve_shards(args.ready, stop)
    else:
        _train(args.ready, args.stats, stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
