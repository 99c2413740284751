"""Multi-neighbour state replication: donors serve shards, a joiner pulls them in parallel.

Wire (ZeroMQ over TCP; every message a typed, versioned msgspec schema, msgpack-encoded, never
pickled):

* the joiner opens one DEALER per donor; each donor's :class:`ShardServer` binds a ROUTER;
* requests are one frame: :class:`ManifestRequest` or :class:`ShardRequest`;
* replies are a header frame (:class:`ManifestReply`, :class:`ShardReply` or :class:`Refusal`)
  followed, for the first two, by one payload frame (the manifest, or the shard's bytes sent
  zero-copy from the donor's tensors).

A donor serves one snapshot, consistent for one ``(epoch, step)``: it calls
:meth:`ShardServer.publish` after the allreduce and must not step its optimizer until the joiner
is done (the payload is read from the live tensors). Every untrusted request goes through
:func:`validate_request`, which turns it into a request or a :class:`Refusal` with a reason code;
the server answers and keeps serving. The messages live in :mod:`chaos.replication_wire` and are
re-exported here.

:func:`pull_state` is the joiner's side; see ``docs/state.md`` for the failure handling.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from chaos.errors import (  # ReplicationError re-exported for callers of pull_state
    ChaosTimeout,
    ConfigError,
    ReplicationError,
    StateLayoutError,
)
from chaos.replication_wire import (
    MAX_REQUEST_BYTES,
    REPLICATION_VERSION,
    REPLY_DECODER,
    WIRE_ENCODER,
    ManifestReply,
    ManifestRequest,
    Refusal,
    ShardReason,
    ShardReply,
    ShardRequest,
    WireMessage,
    manifest_digest,
    refusal,
    shard_checksum,
    validate_request,
)
from chaos.scheduling import METHODS, Neighbor, Plan, plan_replication
from chaos.state import TrainingState

log = logging.getLogger("chaos.replication")

__all__ = [
    "DIE_EXIT_CODE",
    "MAX_REQUEST_BYTES",
    "REPLICATION_VERSION",
    "ManifestReply",
    "ManifestRequest",
    "PullConfig",
    "PullStats",
    "Refusal",
    "ReplicationError",
    "ServerFaults",
    "ShardReason",
    "ShardReply",
    "ShardRequest",
    "ShardServer",
    "ShardServerConfig",
    "fetch_manifest",
    "latest_manifest",
    "manifest_digest",
    "pull_state",
    "shard_checksum",
    "validate_request",
]

DIE_EXIT_CODE = 70
"""Exit status of a donor process killed by :attr:`ServerFaults.die_after_shards`."""


# ----------------------------------------------------------------------------- server


@dataclass(frozen=True)
class ShardServerConfig:
    """Configuration of a :class:`ShardServer`.

    Args:
        listen: ``tcp://HOST:PORT`` to bind; port ``0`` or ``*`` picks a free port (see
            ``ShardServer.address``).
        max_shard_bytes: Largest shard served; larger requests are refused as ``too_large``.
            Raise it only if plans use bigger shards.
        poll_interval_s: How often the serving thread checks for shutdown, in seconds. Lower
            makes ``close`` return sooner; it does not affect serving latency.
    """

    listen: str = "tcp://127.0.0.1:0"
    max_shard_bytes: int = 64 << 20
    poll_interval_s: float = 0.05

    def __post_init__(self) -> None:
        if not isinstance(self.listen, str) or not self.listen.startswith("tcp://"):
            raise ConfigError(f"listen must be tcp://HOST:PORT, got {self.listen!r}")
        host, sep, port = self.listen[len("tcp://") :].rpartition(":")
        port_ok = port == "*" or (port.isdigit() and int(port) <= 65535)
        if not sep or not host or not port_ok:
            raise ConfigError(f"listen must be tcp://HOST:PORT, got {self.listen!r}")
        if isinstance(self.max_shard_bytes, bool) or not isinstance(self.max_shard_bytes, int):
            raise ConfigError("max_shard_bytes must be an int")
        if self.max_shard_bytes <= 0:
            raise ConfigError(f"max_shard_bytes must be > 0, got {self.max_shard_bytes}")
        if not isinstance(self.poll_interval_s, (int, float)) or not self.poll_interval_s > 0:
            raise ConfigError(f"poll_interval_s must be > 0, got {self.poll_interval_s!r}")


@dataclass(frozen=True)
class ServerFaults:
    """Named faults a :class:`ShardServer` injects, for tests and the harness.

    Args:
        corrupt_offsets: Shards starting at these stream offsets are sent with one byte flipped
            (in the sent payload only; the donor's state is untouched) and the true checksum.
        corrupt_times: How many times each offset is corrupted; ``None``: every time.
        die_after_shards: After this many shards were sent, the next shard request makes the
            whole donor process exit with :data:`DIE_EXIT_CODE` (a crash, no goodbye).
        stall_after_shards: After this many shards were sent, the server silently ignores every
            request (a hung donor whose process stays alive).
    """

    corrupt_offsets: frozenset[int] = frozenset()
    corrupt_times: int | None = 1
    die_after_shards: int | None = None
    stall_after_shards: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "corrupt_offsets", frozenset(self.corrupt_offsets))
        for name in ("corrupt_times", "die_after_shards", "stall_after_shards"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ConfigError(f"{name} must be None or an int >= 0, got {value!r}")


@dataclass
class ServerStats:
    """Counters of a :class:`ShardServer`."""

    shards_sent: int = 0
    bytes_sent: int = 0
    manifests_sent: int = 0
    corrupted: int = 0
    refusals: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class _Snapshot:
    state: TrainingState
    epoch: int
    step: int
    digest: str


class ShardServer:
    """Serves shards of a donor's published state from a ROUTER socket, on its own thread.

    Args:
        config: Bind address and limits.
        faults: Named faults to inject (tests only).
        context: ZeroMQ context to use (default: the process's shared instance).

    Raises:
        ConfigError: the listen address cannot be bound.
    """

    def __init__(
        self,
        config: ShardServerConfig | None = None,
        *,
        faults: ServerFaults | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self.config = config or ShardServerConfig()
        self.faults = faults or ServerFaults()
        self._ctx = context or zmq.Context.instance()
        self._lock = threading.Lock()
        self._snapshot: _Snapshot | None = None
        self._stats = ServerStats()
        self._corrupt_counts: dict[int, int] = {}
        self._stalled = False
        self._stop = threading.Event()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        bind = self.config.listen
        if bind.endswith(":0"):
            bind = bind[:-2] + ":*"
        try:
            sock.bind(bind)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ConfigError(f"cannot bind shard server to {self.config.listen}: {exc}") from exc
        self.address: str = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="chaos-shard-server", daemon=True)
        self._thread.start()

    def publish(self, state: TrainingState, epoch: int, step: int) -> None:
        """Starts serving ``state`` as the snapshot of ``(epoch, step)``, replacing any other.

        The state's tensors are read live: do not change them (no optimizer step) until the
        joiners are done, or call :meth:`retire` first.
        """
        if not isinstance(state, TrainingState):
            raise TypeError(f"publish takes a TrainingState, got {type(state).__name__}")
        snap = _Snapshot(state, epoch, step, manifest_digest(state.manifest_bytes))
        with self._lock:
            self._snapshot = snap

    def retire(self) -> None:
        """Stops serving the snapshot; later requests are refused as ``not_published``."""
        with self._lock:
            self._snapshot = None

    def stats(self) -> ServerStats:
        """A copy of the server's counters."""
        with self._lock:
            s = self._stats
            return replace(s, refusals=dict(s.refusals))

    def close(self, timeout_s: float = 5.0) -> None:
        """Stops the serving thread and closes the socket.

        Raises:
            ChaosTimeout: the thread did not stop within ``timeout_s`` seconds.
        """
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise ChaosTimeout(f"shard server did not stop within {timeout_s} s")

    def __enter__(self) -> ShardServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- serving thread

    def _serve(self) -> None:
        poll_ms = max(1, int(self.config.poll_interval_s * 1000))
        try:
            while not self._stop.is_set():
                try:
                    if not self._sock.poll(poll_ms):
                        continue
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                try:
                    self._handle(frames)
                except Exception:  # the server never dies of one request
                    log.exception("shard server: request handling failed")
        finally:
            self._sock.close(linger=0)

    def _send(self, ident: bytes, header: WireMessage, payload: Any = None) -> None:
        frames: list[Any] = [ident, WIRE_ENCODER.encode(header)]
        if payload is not None:
            frames.append(payload)
        self._sock.send_multipart(frames, copy=False)

    def _handle(self, frames: list[bytes]) -> None:
        if self._stalled:
            return
        if len(frames) < 2:
            return  # no routing id and body: nothing to answer to
        ident = frames[0]
        req = validate_request(frames[1:])
        if isinstance(req, ShardRequest):
            self._maybe_die()
            if self._stalled:
                return
        reply: WireMessage
        payload: Any = None
        with self._lock:
            snap = self._snapshot
        if isinstance(req, Refusal):
            reply = req
        elif isinstance(req, ManifestRequest):
            refused = self._check_snapshot(snap, req)
            if refused is not None or snap is None:
                reply = refused or refusal(req.req_id, ShardReason.NOT_PUBLISHED, "")
            else:
                reply = ManifestReply(
                    req_id=req.req_id, epoch=snap.epoch, step=snap.step, digest=snap.digest
                )
                payload = snap.state.manifest_bytes
        else:
            reply, payload = self._shard(snap, req)
        with self._lock:
            if isinstance(reply, Refusal):
                self._stats.refusals[reply.reason] = self._stats.refusals.get(reply.reason, 0) + 1
            elif isinstance(reply, ShardReply):
                self._stats.shards_sent += 1
                self._stats.bytes_sent += reply.length
            else:
                self._stats.manifests_sent += 1
        self._send(ident, reply, payload)

    def _maybe_die(self) -> None:
        sent = self._stats.shards_sent
        f = self.faults
        if f.die_after_shards is not None and sent >= f.die_after_shards:
            log.warning("shard server: injected fault die_after_shards=%d", f.die_after_shards)
            os._exit(DIE_EXIT_CODE)
        if f.stall_after_shards is not None and sent >= f.stall_after_shards:
            self._stalled = True

    @staticmethod
    def _check_snapshot(
        snap: _Snapshot | None, req: ManifestRequest | ShardRequest
    ) -> Refusal | None:
        if snap is None:
            return refusal(req.req_id, ShardReason.NOT_PUBLISHED, "no state is published")
        step = snap.step if isinstance(req, ManifestRequest) and req.step is None else req.step
        epoch = req.epoch
        if isinstance(req, ManifestRequest) and req.newer_ok and snap.epoch >= req.epoch:
            epoch = snap.epoch
        if (epoch, step) != (snap.epoch, snap.step):
            return refusal(
                req.req_id,
                ShardReason.STALE_STATE,
                f"asked for (epoch {req.epoch}, step {req.step}), "
                f"serving (epoch {snap.epoch}, step {snap.step})",
            )
        return None

    def _shard(self, snap: _Snapshot | None, req: ShardRequest) -> tuple[WireMessage, Any]:
        refused = self._check_snapshot(snap, req)
        if refused is not None or snap is None:
            return refused or refusal(req.req_id, ShardReason.NOT_PUBLISHED, ""), None
        state = snap.state
        if req.fingerprint != state.layout_fingerprint():
            return refusal(req.req_id, ShardReason.LAYOUT_MISMATCH, "other state layout"), None
        if req.digest != snap.digest:
            return refusal(req.req_id, ShardReason.MANIFEST_MISMATCH, "other manifest"), None
        if req.length > self.config.max_shard_bytes:
            detail = f"{req.length} bytes > max_shard_bytes {self.config.max_shard_bytes}"
            return refusal(req.req_id, ShardReason.TOO_LARGE, detail), None
        if req.length == 0 or req.offset + req.length > state.total_bytes:
            detail = f"[{req.offset}, +{req.length}) of a {state.total_bytes}-byte stream"
            return refusal(req.req_id, ShardReason.OUT_OF_RANGE, detail), None
        payload: Any = state.read(req.offset, req.length)
        checksum = shard_checksum(payload)
        payload = self._maybe_corrupt(req.offset, payload)
        reply = ShardReply(
            req_id=req.req_id,
            epoch=snap.epoch,
            step=snap.step,
            offset=req.offset,
            length=req.length,
            checksum=checksum,
        )
        return reply, payload

    def _maybe_corrupt(self, offset: int, payload: memoryview) -> Any:
        f = self.faults
        if offset not in f.corrupt_offsets:
            return payload
        done = self._corrupt_counts.get(offset, 0)
        if f.corrupt_times is not None and done >= f.corrupt_times:
            return payload
        self._corrupt_counts[offset] = done + 1
        with self._lock:
            self._stats.corrupted += 1
        bad = bytearray(payload)  # a copy: the donor's own state stays intact
        bad[len(bad) // 2] ^= 0x5A
        return bad


# ----------------------------------------------------------------------------- joiner


def _check_timeout(timeout_s: float, name: str = "timeout_s") -> None:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"{name} must be a number of seconds")
    if not timeout_s > 0:
        raise ValueError(f"{name} must be > 0, got {timeout_s!r}")


def latest_manifest(
    address: str, min_epoch: int, timeout_s: float, *, context: zmq.Context | None = None
) -> tuple[bytes, int, int]:
    """Asks one donor for the manifest of whatever it published under ``min_epoch`` or later.

    A joiner uses this: the donors publish at their next step boundary, under the epoch they
    install there, which may be newer than the one that named them.

    Returns:
        ``(manifest, epoch, step)`` of the published snapshot; pull from this donor with them.

    Raises:
        ChaosTimeout: no answer within ``timeout_s``.
        ReplicationError: the donor refused (nothing published, or an older epoch) or answered
            something malformed.
    """
    req = ManifestRequest(req_id=1, epoch=min_epoch, step=None, newer_ok=True)
    manifest, head = _manifest_exchange(address, req, timeout_s, context)
    return manifest, head.epoch, head.step


def fetch_manifest(
    address: str,
    epoch: int,
    step: int | None,
    timeout_s: float,
    *,
    context: zmq.Context | None = None,
) -> tuple[bytes, int]:
    """Asks one donor for the encoded manifest of its state at ``(epoch, step)``.

    Build the joiner's state from it with :meth:`TrainingState.for_joiner`.

    Args:
        address: The donor's ``ShardServer.address``.
        epoch: Membership epoch of the snapshot.
        step: Training step of the snapshot; ``None``: whatever step the donor published for
            ``epoch`` (a joiner does not know the donors' step in advance).
        timeout_s: How long to wait for the answer, in seconds.
        context: ZeroMQ context (default: the process's shared instance).

    Returns:
        ``(manifest, step)``: the encoded manifest, checked against the digest in the reply
        header, and the step of the published snapshot (pull with that step).

    Raises:
        ChaosTimeout: no answer within ``timeout_s``.
        ReplicationError: the donor refused (stale snapshot, nothing published) or answered
            something malformed.
    """
    req = ManifestRequest(req_id=1, epoch=epoch, step=step)
    manifest, head = _manifest_exchange(address, req, timeout_s, context)
    return manifest, head.step


def _manifest_exchange(
    address: str, req: ManifestRequest, timeout_s: float, context: zmq.Context | None
) -> tuple[bytes, ManifestReply]:
    _check_timeout(timeout_s)
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send(WIRE_ENCODER.encode(req))
        if not sock.poll(int(timeout_s * 1000)):
            raise ChaosTimeout(f"donor {address} sent no manifest within {timeout_s} s")
        frames = sock.recv_multipart()
    finally:
        sock.close(linger=0)
    try:
        head = REPLY_DECODER.decode(frames[0])
    except msgspec.DecodeError as exc:
        raise ReplicationError(f"donor {address} sent a malformed reply: {exc}") from exc
    if isinstance(head, Refusal):
        raise ReplicationError(
            f"donor {address} refused the manifest: {head.reason}: {head.detail}"
        )
    if not isinstance(head, ManifestReply) or len(frames) != 2:
        raise ReplicationError(f"donor {address} answered a manifest request with {head!r}")
    if manifest_digest(frames[1]) != head.digest:
        raise ReplicationError(f"donor {address} sent a manifest that fails its digest")
    return frames[1], head


@dataclass(frozen=True)
class PullConfig:
    """Configuration of :func:`pull_state`.

    Args:
        window: Outstanding shard requests per donor. Raise it on long, fat links so that a
            donor always has a shard queued; 1 makes every shard cost a round trip.
        request_timeout_s: A donor that sends nothing for this long (plus three times the
            time its planned link needs for the bytes in flight) while requests are outstanding
            is declared dead and its shards re-planned.
        max_shard_attempts: A shard that fails its checksum this many times in all (over every
            donor) fails the pull.
        replan_method: Planner for re-planning a dead donor's shards (``plan_replication``'s
            ``method``).
        min_shard_bytes: Smallest shard size a re-plan considers.
        max_request_bytes: A planned shard larger than this is fetched as several requests
            (each with its own checksum). Keep it at or below the donors'
            ``ShardServerConfig.max_shard_bytes``; smaller values re-fetch less after a
            corruption but cost more messages.
        unpublished_grace_s: A donor that answers ``not_published`` (it has not reached the
            step boundary where it publishes its snapshot) is asked again every
            ``unpublished_retry_s`` for this long before it is dropped. Set it above the
            longest training step of the donors.
        unpublished_retry_s: Pause between those retries.
    """

    window: int = 8
    request_timeout_s: float = 10.0
    max_shard_attempts: int = 6
    replan_method: str = "chaos"
    min_shard_bytes: int = 1024
    max_request_bytes: int = 16 << 20
    unpublished_grace_s: float = 30.0
    unpublished_retry_s: float = 0.02

    def __post_init__(self) -> None:
        for name in ("window", "max_shard_attempts", "min_shard_bytes", "max_request_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        try:
            _check_timeout(self.request_timeout_s, "request_timeout_s")
            _check_timeout(self.unpublished_grace_s, "unpublished_grace_s")
            _check_timeout(self.unpublished_retry_s, "unpublished_retry_s")
        except (TypeError, ValueError) as exc:
            raise ConfigError(str(exc)) from exc
        if self.replan_method not in METHODS or self.replan_method == "milp":
            raise ConfigError(f"replan_method must be one of {METHODS} except milp")


@dataclass
class PullStats:
    """What a pull did.

    Attributes:
        bytes_per_donor: Verified bytes written, per donor.
        shards_per_donor: Verified shards written, per donor.
        checksum_failures: Shards that arrived corrupted (or with a wrong length) and were
            fetched again.
        refetched_elsewhere: Of those, the re-fetches sent to another donor.
        replans: How many times a failed donor's shards were re-planned over the others.
        failed_donors: Donor id -> why it was dropped (a refusal reason code, ``"timeout"``,
            ``"disconnected"``, ``"malformed_reply"``).
        elapsed_s: Wall time of the pull, in seconds.
    """

    bytes_per_donor: dict[str, int] = field(default_factory=dict)
    shards_per_donor: dict[str, int] = field(default_factory=dict)
    checksum_failures: int = 0
    refetched_elsewhere: int = 0
    replans: int = 0
    failed_donors: dict[str, str] = field(default_factory=dict)
    elapsed_s: float = 0.0


Shard = tuple[int, int]


class _Donor:
    def __init__(self, nid: str, address: str, neighbor: Neighbor) -> None:
        self.id = nid
        self.address = address
        self.neighbor = neighbor
        self.sock: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self.queue: deque[Shard] = deque()
        self.inflight: dict[int, Shard] = {}
        self.last_progress = 0.0
        self.alive = True
        self.unpublished_since: float | None = None  # first not_published answer
        self.retry_at = 0.0  # no requests before this (monotonic seconds)

    def queued_bytes(self) -> int:
        return sum(n for _, n in self.queue) + sum(n for _, n in self.inflight.values())


class _Puller:
    """One pull: a single thread, one DEALER (and its monitor) per donor, a poller."""

    def __init__(
        self,
        plan: Plan,
        donors: Mapping[str, str],
        state: TrainingState,
        epoch: int | Mapping[str, int],
        step: int,
        neighbors: Sequence[Neighbor],
        config: PullConfig,
        context: zmq.Context,
    ) -> None:
        by_id = {n.id: n for n in neighbors}
        missing = sorted(set(donors) - set(by_id))
        if missing:
            raise ValueError(f"no Neighbor parameters for donors {missing}")
        unknown = sorted(nid for nid, r in plan.assignment.items() if r and nid not in donors)
        if unknown:
            raise ValueError(f"the plan assigns shards to donors without an address: {unknown}")
        if plan.state_bytes != state.total_bytes:
            raise StateLayoutError(
                f"the plan covers {plan.state_bytes} bytes, the joiner's state has "
                f"{state.total_bytes}: plan with joiner_state.tensor_sizes()"
            )
        self.state, self.step = state, step
        self.epochs = {nid: epoch if isinstance(epoch, int) else int(epoch[nid]) for nid in donors}
        self.config, self.ctx, self.plan = config, context, plan
        self.fingerprint = state.layout_fingerprint()
        self.digest = manifest_digest(state.manifest_bytes)
        self.donors = {nid: _Donor(nid, addr, by_id[nid]) for nid, addr in donors.items()}
        self.todo: set[Shard] = set()
        for nid, ranges in plan.assignment.items():
            for off, length in ranges:
                state._check_range(off, length)
                self._enqueue(self.donors[nid], off, length)
        if sum(n for _, n in self.todo) != state.total_bytes:
            raise ValueError("the plan's ranges do not cover the state exactly once")
        self.failures: dict[Shard, dict[str, int]] = {}
        self.stats = PullStats(
            bytes_per_donor={nid: 0 for nid in donors}, shards_per_donor={nid: 0 for nid in donors}
        )
        self.poller = zmq.Poller()
        self.by_sock: dict[zmq.Socket, tuple[_Donor, bool]] = {}
        self.next_id = 1

    # -- sockets

    def _connect(self, d: _Donor) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(d.address)
        d.sock, d.monitor = sock, mon
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(mon, zmq.POLLIN)
        self.by_sock[sock] = (d, False)
        self.by_sock[mon] = (d, True)

    def _disconnect(self, d: _Donor) -> None:
        for s in (d.sock, d.monitor):
            if s is not None:
                self.poller.unregister(s)
                self.by_sock.pop(s, None)
        if d.sock is not None:
            d.sock.disable_monitor()
            d.sock.close(linger=0)
        if d.monitor is not None:
            d.monitor.close(linger=0)
        d.sock = d.monitor = None

    # -- main loop

    def run(self, timeout_s: float) -> PullStats:
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        try:
            for d in self.donors.values():
                self._connect(d)
            while self.todo:
                alive = [d for d in self.donors.values() if d.alive]
                if not alive:
                    raise ReplicationError(
                        "no donor left to pull the state from", self.stats.failed_donors
                    )
                self._fill(alive)
                now = time.monotonic()
                if now >= deadline:
                    raise ChaosTimeout(
                        f"state pull did not finish within {timeout_s} s "
                        f"({sum(n for _, n in self.todo)} bytes missing)"
                    )
                wait_s = min(deadline - now, self.config.request_timeout_s)
                pending = [d.retry_at - now for d in alive if d.retry_at > now and d.queue]
                if pending:
                    wait_s = min(wait_s, max(0.001, min(pending)))
                for sock, _ in self.poller.poll(max(1, int(wait_s * 1000))):
                    entry = self.by_sock.get(sock)
                    if entry is not None:
                        self._on_readable(*entry)
                self._check_timeouts()
        finally:
            for d in self.donors.values():
                self._disconnect(d)
        self.stats.elapsed_s = time.monotonic() - t0
        return self.stats

    def _fill(self, alive: list[_Donor]) -> None:
        now = time.monotonic()
        for d in alive:
            if now < d.retry_at:
                continue
            while d.queue and len(d.inflight) < self.config.window and d.sock is not None:
                off, length = d.queue.popleft()
                if not d.inflight:
                    d.last_progress = time.monotonic()
                req_id = self.next_id
                self.next_id += 1
                req = ShardRequest(
                    req_id=req_id,
                    epoch=self.epochs[d.id],
                    step=self.step,
                    fingerprint=self.fingerprint,
                    digest=self.digest,
                    offset=off,
                    length=length,
                )
                d.inflight[req_id] = (off, length)
                d.sock.send(WIRE_ENCODER.encode(req))

    def _check_timeouts(self) -> None:
        now = time.monotonic()
        for d in self.donors.values():
            if d.alive and d.inflight and now - d.last_progress > self._allowance(d):
                self._fail_donor(d, "timeout")

    def _allowance(self, d: _Donor) -> float:
        """How long a donor may stay silent: ``request_timeout_s``, plus three times what its
        link needs for the bytes in flight (a large shard on a slow link is not a dead donor)."""
        inflight = sum(length for _, length in d.inflight.values())
        return self.config.request_timeout_s + 3.0 * inflight * d.neighbor.trans_s_per_byte

    def _on_readable(self, d: _Donor, is_monitor: bool) -> None:
        if not d.alive:
            return
        if is_monitor:
            if d.monitor is None:
                return
            event = recv_monitor_message(d.monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._fail_donor(d, "disconnected")
            return
        if d.sock is None:
            return
        while d.alive and d.sock is not None:
            try:
                frames = d.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._on_reply(d, frames)

    def _on_reply(self, d: _Donor, frames: list[zmq.Frame]) -> None:
        try:
            head = REPLY_DECODER.decode(frames[0].buffer)
        except msgspec.DecodeError:
            self._fail_donor(d, "malformed_reply")
            return
        shard = d.inflight.pop(head.req_id, None)
        if shard is None:
            return  # an answer to a request this pull gave up on
        d.last_progress = time.monotonic()
        if isinstance(head, Refusal):
            d.queue.appendleft(shard)
            if head.reason == ShardReason.NOT_PUBLISHED and self._still_waiting(d):
                return  # it publishes at its next step boundary: ask again shortly
            self._fail_donor(d, head.reason)
            return
        d.unpublished_since = None
        ok = (
            isinstance(head, ShardReply)
            and len(frames) == 2
            and (head.epoch, head.step) == (self.epochs[d.id], self.step)
            and (head.offset, head.length) == shard
            and len(frames[1].buffer) == head.length
            and shard_checksum(frames[1].buffer) == head.checksum
        )
        if not ok:
            self._bad_shard(d, shard)
            return
        if shard in self.todo:
            self.state.write(shard[0], frames[1].buffer)
            self.todo.discard(shard)
            self.stats.bytes_per_donor[d.id] += shard[1]
            self.stats.shards_per_donor[d.id] += 1

    # -- failure handling

    def _still_waiting(self, d: _Donor) -> bool:
        """Whether a donor that has not published yet is still within its grace period."""
        now = time.monotonic()
        if d.unpublished_since is None:
            d.unpublished_since = now
        if now - d.unpublished_since > self.config.unpublished_grace_s:
            return False
        d.retry_at = now + self.config.unpublished_retry_s
        d.last_progress = now
        return True

    def _bad_shard(self, d: _Donor, shard: Shard) -> None:
        self.stats.checksum_failures += 1
        fails = self.failures.setdefault(shard, {})
        fails[d.id] = fails.get(d.id, 0) + 1
        if sum(fails.values()) >= self.config.max_shard_attempts:
            raise ReplicationError(
                f"shard [{shard[0]}, +{shard[1]}) failed its checksum {sum(fails.values())} "
                f"times (per donor: {fails})",
                self.stats.failed_donors,
            )
        target = d
        if fails[d.id] >= 2:
            others = [o for o in self.donors.values() if o.alive and o is not d]
            if others:
                target = min(others, key=lambda o: (fails.get(o.id, 0), o.queued_bytes()))
                self.stats.refetched_elsewhere += 1
        target.queue.appendleft(shard)

    def _fail_donor(self, d: _Donor, reason: str) -> None:
        log.warning("replication: donor %s dropped (%s)", d.id, reason)
        d.alive = False
        self.stats.failed_donors[d.id] = reason
        orphans = [s for s in [*d.queue, *d.inflight.values()] if s in self.todo]
        d.queue.clear()
        d.inflight.clear()
        self._disconnect(d)
        alive = [o for o in self.donors.values() if o.alive]
        if orphans and alive:
            self._replan(orphans, alive)

    def _replan(self, orphans: list[Shard], alive: list[_Donor]) -> None:
        """Re-plans the orphaned byte ranges over the remaining donors (plan_replication)."""
        pieces: list[Shard] = []
        for off, length in sorted(orphans):
            self.todo.discard((off, length))
            if pieces and pieces[-1][0] + pieces[-1][1] == off:
                pieces[-1] = (pieces[-1][0], pieces[-1][1] + length)
            else:
                pieces.append((off, length))
        c = self.plan.per_shard_cost_s
        nbrs = []
        for o in alive:  # a donor still busy with its own shards starts the new ones later
            busy = o.queued_bytes() * o.neighbor.trans_s_per_byte
            busy += (len(o.queue) + len(o.inflight)) * c
            nbrs.append(replace(o.neighbor, sync_s=o.neighbor.sync_s + busy))
        plan = plan_replication(
            [n for _, n in pieces],
            nbrs,
            c,
            layout="per-tensor",
            method=self.config.replan_method,
            min_shard_bytes=self.config.min_shard_bytes,
        )
        starts = [0]
        for _, n in pieces[:-1]:
            starts.append(starts[-1] + n)
        for nid, ranges in plan.assignment.items():
            for voff, length in ranges:
                k = max(i for i, s in enumerate(starts) if s <= voff)
                self._enqueue(self.donors[nid], pieces[k][0] + voff - starts[k], length)
        self.stats.replans += 1

    def _enqueue(self, d: _Donor, offset: int, length: int) -> None:
        """Queues a planned range, split into requests of at most ``max_request_bytes``."""
        step = self.config.max_request_bytes
        for off in range(offset, offset + length, step):
            shard = (off, min(step, offset + length - off))
            self.todo.add(shard)
            d.queue.append(shard)


def pull_state(
    plan: Plan,
    donors: Mapping[str, str],
    joiner_state: TrainingState,
    epoch: int | Mapping[str, int],
    step: int,
    timeout_s: float,
    *,
    neighbors: Sequence[Neighbor],
    config: PullConfig | None = None,
    context: zmq.Context | None = None,
) -> PullStats:
    """Pulls the state for ``(epoch, step)`` from the donors into ``joiner_state``.

    Every donor's assigned shards are requested in parallel, ``config.window`` at a time per
    donor. Each shard's checksum is verified on arrival; a bad shard is fetched again from the
    same donor, then from another one if it fails again. A donor that dies (disconnects, or sends
    nothing for ``config.request_timeout_s``) or refuses (stale snapshot, other layout) is
    dropped, and its missing shards are re-planned over the remaining donors with
    :func:`chaos.scheduling.plan_replication`. Call ``joiner_state.apply()`` afterwards.

    Args:
        plan: The replication policy over ``joiner_state.tensor_sizes()``.
        donors: Donor id -> ``ShardServer.address``; ids not in the plan only help re-plans.
        joiner_state: The receiving state, from :meth:`TrainingState.for_joiner`.
        epoch: Membership epoch of the snapshot the donors published, or per donor (the
            donors of one step may have published it under different epochs; the manifest
            digest in every request still ensures they serve the same state).
        step: Training step of that snapshot.
        timeout_s: Limit for the whole pull, in seconds.
        neighbors: Link parameters of every donor (for re-plans).
        config: Window, timeouts and retry limits.
        context: ZeroMQ context (default: the process's shared instance).

    Returns:
        What the pull did (bytes per donor, checksum failures, re-plans, elapsed time).

    Raises:
        ChaosTimeout: the pull did not finish within ``timeout_s``.
        ReplicationError: no donor is left, or a shard failed its checksum
            ``config.max_shard_attempts`` times.
        StateLayoutError: the plan does not match the joiner's state.
        ValueError: the plan names donors without an address or Neighbor parameters, or does
            not cover the state exactly once.
    """
    _check_timeout(timeout_s)
    puller = _Puller(
        plan,
        donors,
        joiner_state,
        epoch,
        step,
        neighbors,
        config or PullConfig(),
        context or zmq.Context.instance(),
    )
    return puller.run(timeout_s)
