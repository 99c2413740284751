"""The targets of ``chaos-bench fuzz``: each started, fuzzed, and checked afterwards.

One function per target (:data:`TARGETS`) starts its process, sends it its frames (from
:mod:`chaos.bench.fuzz_frames`) while draining its replies and watching that it stays alive,
then asks it a valid request and reads its RSS. The figures go into a :class:`FuzzTarget`.
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import subprocess
import sys
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import psutil
import zmq

from chaos.bench.fuzz_children import ROUND_TIMEOUT_S
from chaos.bench.fuzz_frames import (
    Mutator,
    control_examples,
    frame_headers,
    lane_garbage,
    shard_examples,
    trainer_frame,
)
from chaos.errors import ChaosError, ProtocolError
from chaos.launch import (
    daemon_command,
    free_tcp_address,
    spawn_daemon,
    spawn_worker,
    wait_until,
)
from chaos.protocol import codec
from chaos.protocol import messages as m

__all__ = ["START_TIMEOUT_S", "TARGETS", "FuzzTarget"]

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
_NOT_LEAVING = (m.LeaveCommand, m.FaultCommand)
"""Well-formed client commands that would make the daemon leave or cut its links: legitimate
behaviour, not bad input; a mutation that decodes to one is not sent."""

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
    """Starts ``python -m chaos.bench.fuzz_children ROLE`` and waits for its ready file."""
    ready = root / f"{role}.ready.json"
    stats = root / f"{role}.stats.json"
    argv = [
        sys.executable,
        "-m",
        "chaos.bench.fuzz_children",
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
    examples = shard_examples()
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
    headers = frame_headers()
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
                kind, raw = lane_garbage(mut, rng)
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
            kind, parts = trainer_frame(mut, rng, headers)
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
                progressed,
                ROUND_TIMEOUT_S + 2 * ANSWER_TIMEOUT_S,
                "another allreduce round",
                watch={"trainer": proc},
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
