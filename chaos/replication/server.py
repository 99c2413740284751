"""The donor's side of state replication: a :class:`ShardServer` serves shards of its state.

A donor binds one ROUTER socket and answers, on its own thread, the joiners' requests for the
manifest and for shards of one published snapshot (see :mod:`chaos.replication.pull` for the wire
and the joiner's side, :mod:`chaos.replication.wire` for the messages). Every untrusted request
goes through :func:`~chaos.replication.wire.validate_request`; a bad one is answered with a
:class:`~chaos.replication.wire.Refusal` and the server keeps serving.

With a cluster key (:class:`~chaos.security.Security`) the ROUTER is a CURVE server of the
cluster: a joiner must hold the key to complete the handshake, so a stranger cannot fetch a
manifest or a shard, and every reply is encrypted. Refused handshakes are logged and counted
(:attr:`ServerStats.handshake_failures`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import zmq

from chaos.errors import ChaosTimeout, ConfigError
from chaos.protocol.messages import Reason, Refusal
from chaos.replication.state import TrainingState
from chaos.replication.steplog import StepLog
from chaos.replication.wire import (
    WIRE_ENCODER,
    ManifestReply,
    ManifestRequest,
    Reply,
    ShardReply,
    ShardRequest,
    StepLogRequest,
    manifest_digest,
    refusal,
    shard_checksum,
    validate_request,
)
from chaos.security import HandshakeRefusal, HandshakeWatch, Security
from chaos.sockets import keep_alive, start_zero_copy_collector

# The server logs under the replication logger, as it did when it lived in chaos.replication.
log = logging.getLogger("chaos.replication.server")

__all__ = [
    "DIE_EXIT_CODE",
    "MAX_MSG_BYTES",
    "ServerFaults",
    "ServerStats",
    "ShardServer",
    "ShardServerConfig",
]

_REFUSALS_LOGGED = 3
"""The server logs this many refused handshakes; it only counts the later ones."""

HANDSHAKE_IVL_MS = 5_000
"""A shard-server connection must finish its handshake within this (milliseconds)."""

MAX_MSG_BYTES = 1 << 20
"""The shard server's frame cap (``MAXMSGSIZE``): a larger frame drops its connection before it
is read into memory. Requests are far smaller; one over
:data:`~chaos.replication.wire.MAX_REQUEST_BYTES` but under this is read and refused
``too_large``."""

DIE_EXIT_CODE = 70
"""Exit status of a donor process killed by :attr:`ServerFaults.die_after_shards`."""


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
    handshake_failures: int = 0
    """Connections refused in the CURVE handshake (no or a different cluster key)."""


@dataclass(frozen=True)
class _Snapshot:
    """One published state with its ``(epoch, step)`` and manifest digest."""

    state: TrainingState
    epoch: int
    step: int
    digest: str
    epochs: frozenset[int] = frozenset()
    """Every epoch this snapshot is the state of (the newest is ``epoch``): a commit that
    comes at the same step (a second joiner admitted before anyone stepped) adds its epoch, so
    both joiners pull the same bytes."""


class ShardServer:
    """Serves shards of a donor's published state from a ROUTER socket, on its own thread.

    Args:
        config: Bind address and limits.
        faults: Named faults to inject (tests only).
        context: ZeroMQ context to use (default: the process's shared instance, or with a
            cluster key a context of the server's own, terminated by :meth:`close`).
        security: The cluster key and this process's keypair (default: none, a plain socket
            anyone who reaches it can read the state from).

    Raises:
        ConfigError: the listen address cannot be bound.
    """

    def __init__(
        self,
        config: ShardServerConfig | None = None,
        *,
        faults: ServerFaults | None = None,
        context: zmq.Context | None = None,
        security: Security | None = None,
    ) -> None:
        self.config = config or ShardServerConfig()
        self.faults = faults or ServerFaults()
        self.security = security if security is not None else Security()
        start_zero_copy_collector()  # shards go out uncopied: its descriptors from now on
        # with a key, a context of its own: its ZAP handler is the server's alone
        self._own_ctx = context is None and self.security.enabled
        self._ctx = context or (zmq.Context() if self._own_ctx else zmq.Context.instance())
        self.security.authenticate(self._ctx)
        self._lock = threading.Lock()
        self._snapshot: _Snapshot | None = None
        self._step_log: StepLog | None = None
        self._stats = ServerStats()
        self._corrupt_counts: dict[int, int] = {}
        self._stalled = False
        self._before_die: Callable[[], None] | None = None
        self._stop = threading.Event()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        keep_alive(sock)  # drops a joiner's half-open connection
        # a connection that has not completed its handshake within this is dropped, so idle
        # strangers do not hold the trainer's descriptors for libzmq's 30 s
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MSG_BYTES)
        self.security.server(sock)
        self._handshakes: HandshakeWatch | None = None
        if self.security.enabled:
            self._handshakes = HandshakeWatch(
                sock, on_refused=self._count_refusal, report=self._log_refusal,
                log_first=_REFUSALS_LOGGED,
            )  # fmt: skip
        bind = self.config.listen
        if bind.endswith(":0"):
            bind = bind[:-2] + ":*"
        try:
            sock.bind(bind)
        except zmq.ZMQError as exc:
            self._sock = sock
            self._close_sockets()
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
        snap = _Snapshot(state, epoch, step, manifest_digest(state.manifest_bytes),
                         frozenset((epoch,)))  # fmt: skip
        with self._lock:
            self._snapshot = snap

    def also_serve(self, epoch: int, step: int) -> bool:
        """Serves the published snapshot of ``step`` as the state of ``epoch`` too (a newer
        epoch committed at the same step, while an older joiner may still be pulling it).

        Returns:
            ``False`` when the published snapshot is not of ``step`` (nothing changes).
        """
        with self._lock:
            snap = self._snapshot
            if snap is None or snap.step != step:
                return False
            self._snapshot = replace(snap, epoch=max(snap.epoch, epoch),
                                     epochs=snap.epochs | {epoch})  # fmt: skip
        return True

    def set_step_log(self, log: StepLog | None) -> None:
        """Serves ``log`` to a catching-up joiner (``None``: no log; requests are refused as
        ``not_published``)."""
        with self._lock:
            self._step_log = log

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
        """The serving thread: answers requests until :meth:`close`, then closes the socket."""
        poll_ms = max(1, int(self.config.poll_interval_s * 1000))
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        if self._handshakes is not None:
            poller.register(self._handshakes.monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                try:
                    ready = dict(poller.poll(poll_ms))
                    if self._handshakes is not None and self._handshakes.monitor in ready:
                        self._handshakes.drain()
                    if self._sock not in ready:
                        continue
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                try:
                    self._handle(frames)
                except Exception:  # the server never dies of one request
                    log.exception("shard server: request handling failed")
        finally:
            self._close_sockets()

    def _count_refusal(self, _refusal: HandshakeRefusal) -> None:
        """Counts a connection refused in the CURVE handshake."""
        with self._lock:
            self._stats.handshake_failures += 1

    def _log_refusal(self, refusal: HandshakeRefusal) -> None:
        """Logs one of the first connections refused in the CURVE handshake."""
        log.warning(
            "shard server %s refused a connection: CURVE handshake failed (%s): the "
            "joiner has no or a different cluster key", self.address, refusal.detail,
        )  # fmt: skip

    def _close_sockets(self) -> None:
        """Closes the socket (and its monitor), then the server's own context."""
        if self._handshakes is not None:
            self._handshakes.close()
        self._sock.close(linger=0)
        self.security.release(self._ctx)
        if self._own_ctx:
            self._ctx.term()

    def _send(self, ident: bytes, header: Reply, payload: Any = None) -> None:
        """Sends a reply header (and its payload frame, if any, zero-copy) to ``ident``."""
        frames: list[Any] = [ident, WIRE_ENCODER.encode(header)]
        if payload is not None:
            frames.append(payload)
        self._sock.send_multipart(frames, copy=False)

    def _send_many(self, ident: bytes, header: Reply, payload: list[Any]) -> None:
        """Sends a reply header and several payload frames (a step log), zero-copy."""
        with self._lock:
            if isinstance(header, Refusal):
                self._stats.refusals[header.reason] = self._stats.refusals.get(header.reason, 0) + 1
        self._sock.send_multipart([ident, WIRE_ENCODER.encode(header), *payload], copy=False)

    def _handle(self, frames: list[bytes]) -> None:
        """Answers one request (``[routing id, body]``), counting what was sent."""
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
        reply: Reply
        payload: Any = None
        with self._lock:
            snap, step_log = self._snapshot, self._step_log
        if isinstance(req, Refusal):
            reply = req
        elif isinstance(req, StepLogRequest):
            if step_log is None:
                reply = refusal(req.req_id, Reason.NOT_PUBLISHED, "no step log")
            else:
                reply, frames_out = step_log.answer(req)
                self._send_many(ident, reply, frames_out)
                return
        elif isinstance(req, ManifestRequest):
            refused = self._check_snapshot(snap, req)
            if refused is not None or snap is None:
                reply = refused or refusal(req.req_id, Reason.NOT_PUBLISHED, "")
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

    def die_after(self, shards: int, before_exit: Callable[[], None] | None = None) -> None:
        """Fault injection by name: once ``shards`` more shards were sent from now, the next shard
        request makes the whole process exit with :data:`DIE_EXIT_CODE` (after ``before_exit``,
        e.g. killing the device's daemon), as :attr:`ServerFaults.die_after_shards` does.

        Raises:
            ValueError: ``shards`` is negative.
        """
        if not isinstance(shards, int) or shards < 0:
            raise ValueError(f"shards must be an int >= 0, got {shards!r}")
        with self._lock:
            sent = self._stats.shards_sent
            self.faults = replace(self.faults, die_after_shards=sent + shards)
            self._before_die = before_exit

    def _maybe_die(self) -> None:
        """Applies the ``die_after_shards`` and ``stall_after_shards`` faults."""
        sent = self._stats.shards_sent
        f = self.faults
        if f.die_after_shards is not None and sent >= f.die_after_shards:
            log.warning("shard server: injected fault die_after_shards=%d", f.die_after_shards)
            if self._before_die is not None:
                self._before_die()
            os._exit(DIE_EXIT_CODE)
        if f.stall_after_shards is not None and sent >= f.stall_after_shards:
            self._stalled = True

    @staticmethod
    def _check_snapshot(
        snap: _Snapshot | None, req: ManifestRequest | ShardRequest
    ) -> Refusal | None:
        """A refusal if nothing is published or the request names another snapshot."""
        if snap is None:
            return refusal(req.req_id, Reason.NOT_PUBLISHED, "no state is published")
        step = snap.step if isinstance(req, ManifestRequest) and req.step is None else req.step
        epoch = req.epoch
        if isinstance(req, ManifestRequest) and req.newer_ok and snap.epoch >= req.epoch:
            epoch = snap.epoch
        if step != snap.step or (epoch != snap.epoch and epoch not in snap.epochs):
            return refusal(
                req.req_id,
                Reason.STALE_STATE,
                f"asked for (epoch {req.epoch}, step {req.step}), "
                f"serving (epoch {snap.epoch}, step {snap.step})",
            )
        return None

    def _shard(self, snap: _Snapshot | None, req: ShardRequest) -> tuple[Reply, Any]:
        """The reply to a shard request and its payload (``None`` with a refusal)."""
        refused = self._check_snapshot(snap, req)
        if refused is not None or snap is None:
            return refused or refusal(req.req_id, Reason.NOT_PUBLISHED, ""), None
        state = snap.state
        if req.fingerprint != state.layout_fingerprint():
            return refusal(req.req_id, Reason.LAYOUT_MISMATCH, "other state layout"), None
        if req.digest != snap.digest:
            return refusal(req.req_id, Reason.MANIFEST_MISMATCH, "other manifest"), None
        if req.length > self.config.max_shard_bytes:
            detail = f"{req.length} bytes > max_shard_bytes {self.config.max_shard_bytes}"
            return refusal(req.req_id, Reason.TOO_LARGE, detail), None
        if req.length == 0 or req.offset + req.length > state.total_bytes:
            detail = f"[{req.offset}, +{req.length}) of a {state.total_bytes}-byte stream"
            return refusal(req.req_id, Reason.OUT_OF_RANGE, detail), None
        payload: Any = state.read(req.offset, req.length)
        checksum = shard_checksum(payload)
        payload = self._maybe_corrupt(req.offset, payload)
        reply = ShardReply(
            req_id=req.req_id,
            epoch=req.epoch,  # one the snapshot serves (checked above): what the joiner asked
            step=snap.step,
            offset=req.offset,
            length=req.length,
            checksum=checksum,
        )
        return reply, payload

    def _maybe_corrupt(self, offset: int, payload: memoryview) -> Any:
        """The payload to send: a corrupted copy where ``corrupt_offsets`` says so."""
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
