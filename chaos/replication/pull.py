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
the server answers and keeps serving. The messages live in :mod:`chaos.replication.wire`, the
donor's server in :mod:`chaos.replication.server`.

With a cluster key (the ``security`` argument, a :class:`~chaos.security.Security`) every
DEALER is a CURVE client of the cluster: the donors' servers accept only key holders, and a
donor with another key is dropped at once (its handshake fails) instead of timing out.

:func:`pull_state` is the joiner's side; see ``docs/state.md`` for the failure handling.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from chaos.errors import (  # ReplicationError re-exported for callers of pull_state
    ChaosTimeout,
    ConfigError,
    ReplicationError,
    StateLayoutError,
)
from chaos.protocol.messages import Reason, Refusal, merge_ranges
from chaos.replication.donor_requests import NO_KEY, check_timeout
from chaos.replication.plan_choice import choose_plan, plan_for_snapshot
from chaos.replication.state import TrainingState
from chaos.replication.wire import (
    REPLY_DECODER,
    WIRE_ENCODER,
    Reply,
    ShardReply,
    ShardRequest,
    manifest_digest,
    shard_checksum,
)
from chaos.scheduling import METHODS, Neighbor, Plan, plan_replication
from chaos.security import HANDSHAKE_FAILED_EVENTS, Security, handshake_error

log = logging.getLogger("chaos.replication.pull")

__all__ = [
    "PullConfig",
    "PullStats",
    "choose_plan",
    "plan_for_snapshot",
    "pull_state",
]


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
            check_timeout(self.request_timeout_s, "request_timeout_s")
            check_timeout(self.unpublished_grace_s, "unpublished_grace_s")
            check_timeout(self.unpublished_retry_s, "unpublished_retry_s")
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
        checksum_failures: Shards rejected (a wrong checksum, length, range or snapshot in the
            reply) and fetched again.
        refetched_elsewhere: Of those, the re-fetches sent to another donor.
        replans: How many times a failed donor's shards were re-planned over the others.
        failed_donors: Donor id -> why it was dropped (a refusal reason code, ``"timeout"``,
            ``"disconnected"``, ``"malformed_reply"``, ``"handshake_failed"``: another
            cluster key).
        elapsed_s: Wall time of the pull, in seconds.
        elapsed_per_donor: Per donor, seconds from sending the request that brought its first
            shard to receiving its last one (its part of the transfer: the wait for a donor
            that had not published yet is left out). The scheduler fits the per-shard cost c
            to it.
        ranges_per_donor: Per donor, the byte ranges it delivered, adjacent ones merged: the
            assignment the pull executed.
    """

    bytes_per_donor: dict[str, int] = field(default_factory=dict)
    shards_per_donor: dict[str, int] = field(default_factory=dict)
    checksum_failures: int = 0
    refetched_elsewhere: int = 0
    replans: int = 0
    failed_donors: dict[str, str] = field(default_factory=dict)
    elapsed_s: float = 0.0
    elapsed_per_donor: dict[str, float] = field(default_factory=dict)
    ranges_per_donor: dict[str, list[tuple[int, int]]] = field(default_factory=dict)


Shard = tuple[int, int]

ProgressFn = Callable[[int, int, Mapping[str, int]], None]
"""Told of a pull's progress: verified bytes so far, bytes to pull, verified bytes per donor."""


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
        self.sent_at: dict[int, float] = {}  # when each outstanding request was sent
        self.first_at: float | None = None  # when the request of its first shard was sent
        self.last_at = 0.0  # when its last shard arrived
        self.delivered: list[Shard] = []  # the ranges it delivered, adjacent ones merged

    def delivered_range(self, shard: Shard) -> None:
        """Notes a delivered range (merged with the last one when adjacent)."""
        last = self.delivered[-1] if self.delivered else None
        if last is not None and last[0] + last[1] == shard[0]:
            self.delivered[-1] = (last[0], last[1] + shard[1])
        else:
            self.delivered.append(shard)

    def queued_bytes(self) -> int:
        return sum(n for _, n in self.queue) + sum(n for _, n in self.inflight.values())


def _mismatch(head: Reply, frames: list[zmq.Frame], key: tuple[int, int], shard: Shard) -> str:
    """Why a shard reply cannot be written (``""``: it can): the snapshot, the range, the
    length or the checksum differs from what was asked."""
    if not isinstance(head, ShardReply) or len(frames) != 2:
        return "not a shard reply with one payload frame"
    if (head.epoch, head.step) != key:
        return f"(epoch, step) ({head.epoch}, {head.step}) answers a request for {key}"
    if (head.offset, head.length) != shard:
        return f"range [{head.offset}, +{head.length}) answers another request"
    if len(frames[1].buffer) != head.length:
        return f"{len(frames[1].buffer)} payload bytes, the header says {head.length}"
    if shard_checksum(frames[1].buffer) != head.checksum:
        return "checksum mismatch"
    return ""


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
        security: Security | None = None,
        on_progress: ProgressFn | None = None,
    ) -> None:
        self.security = security if security is not None else Security()
        self.on_progress = on_progress
        by_id = {n.id: n for n in neighbors}
        missing = sorted(set(donors) - set(by_id))
        if missing:
            raise ValueError(f"no Neighbor parameters for donors {missing}")
        unknown = sorted(nid for nid, r in plan.assignment.items() if r and nid not in donors)
        if unknown:
            raise ValueError(f"the plan assigns shards to donors without an address: {unknown}")
        needed = state.missing()  # all of it, less the chunks a joiner already holds
        need = sum(n for _, n in needed)
        if plan.state_bytes != need:
            raise StateLayoutError(
                f"the plan covers {plan.state_bytes} bytes, the joiner's state lacks {need} of "
                f"{state.total_bytes}: plan with joiner_state.missing()"
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
        todo = [(sh[0], sh[1]) for sh in self.todo]
        if sum(n for _, n in todo) != need or merge_ranges(todo) != merge_ranges(needed):
            raise ValueError("the plan's ranges do not cover the missing bytes exactly once")
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
        self.security.client(sock)
        # a disconnect, a refused connection (the donor was gone before the pull began), or a
        # refused handshake (another cluster key)
        mon = sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | HANDSHAKE_FAILED_EVENTS
        )
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
                    failed = self.stats.failed_donors
                    raise ReplicationError(
                        "no donor left to pull the state from", failed,
                        unreachable=tuple(d.address for d in self.donors.values()
                                          if failed.get(d.id) == "unreachable"),
                    )  # fmt: skip
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
        for d in self.donors.values():
            self.stats.ranges_per_donor[d.id] = merge_ranges(d.delivered)
            if d.first_at is not None:
                self.stats.elapsed_per_donor[d.id] = max(0.0, d.last_at - d.first_at)
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
                d.sent_at[req_id] = time.monotonic()
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
            event = recv_monitor_message(d.monitor)["event"]
            if handshake_error(event) is not None:
                log.warning("donor %s at %s: %s", d.id, d.address, NO_KEY)
                self._fail_donor(d, "handshake_failed")
            elif event == zmq.EVENT_DISCONNECTED:
                self._fail_donor(d, "disconnected")
            elif event == zmq.EVENT_CONNECT_RETRIED:
                self._fail_donor(d, "unreachable")
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
        sent_at = d.sent_at.pop(head.req_id, None)
        if shard is None:
            return  # an answer to a request this pull gave up on
        d.last_progress = time.monotonic()
        if isinstance(head, Refusal):
            d.queue.appendleft(shard)
            if head.reason == Reason.NOT_PUBLISHED and self._still_waiting(d):
                return  # it publishes at its next step boundary: ask again shortly
            self._fail_donor(d, head.reason)
            return
        d.unpublished_since = None
        why = _mismatch(head, frames, (self.epochs[d.id], self.step), shard)
        if why:
            self._bad_shard(d, shard, why)
            return
        if shard in self.todo:
            self.state.write(shard[0], frames[1].buffer)
            self.todo.discard(shard)
            self.stats.bytes_per_donor[d.id] += shard[1]
            self.stats.shards_per_donor[d.id] += 1
            if self.on_progress is not None:
                done = sum(self.stats.bytes_per_donor.values())
                self.on_progress(done, self.plan.state_bytes, self.stats.bytes_per_donor)
            if d.first_at is None:
                d.first_at = sent_at if sent_at is not None else d.last_progress
            d.last_at = d.last_progress
            d.delivered_range(shard)

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

    def _bad_shard(self, d: _Donor, shard: Shard, why: str) -> None:
        self.stats.checksum_failures += 1
        fails = self.failures.setdefault(shard, {})
        fails[d.id] = fails.get(d.id, 0) + 1
        log.warning("replication: shard [%d, +%d) from %s rejected: %s", *shard, d.id, why)
        if sum(fails.values()) >= self.config.max_shard_attempts:
            raise ReplicationError(
                f"shard [{shard[0]}, +{shard[1]}) was rejected {sum(fails.values())} "
                f"times (per donor: {fails}; last: {why})",
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
        d.sent_at.clear()
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
    security: Security | None = None,
    on_progress: ProgressFn | None = None,
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
        security: The cluster key (default: none, plain connections); a donor that refuses
            the handshake (another key) is dropped like a dead one.
        on_progress: Called after every verified shard with the bytes verified so far, the
            bytes to pull and the bytes per donor (it must return quickly: a progress bar, a
            log line now and then).

    Returns:
        What the pull did (bytes per donor, checksum failures, re-plans, elapsed time).

    Raises:
        ChaosTimeout: the pull did not finish within ``timeout_s``.
        ReplicationError: no donor is left, or a shard was rejected
            ``config.max_shard_attempts`` times.
        StateLayoutError: the plan does not match the joiner's state.
        ValueError: the plan names donors without an address or Neighbor parameters, or does
            not cover the state exactly once.
    """
    check_timeout(timeout_s)
    puller = _Puller(
        plan,
        donors,
        joiner_state,
        epoch,
        step,
        neighbors,
        config or PullConfig(),
        context or zmq.Context.instance(),
        security,
        on_progress,
    )
    return puller.run(timeout_s)
