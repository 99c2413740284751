"""A joiner's requests to one donor: the manifest of its published snapshot, and one request
and its reply (shards, step logs), over a DEALER that notices a gone donor or a failed CURVE
handshake at once instead of waiting out the timeout.

:func:`gather_manifests` asks every donor for its manifest and waits (up to a grace) for them to
publish the same snapshot; :mod:`chaos.replication.pull` then pulls the shards.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from chaos.errors import ChaosTimeout, ReplicationError
from chaos.protocol.messages import Refusal
from chaos.replication.wire import (
    REPLY_DECODER,
    WIRE_ENCODER,
    ManifestReply,
    ManifestRequest,
    Reply,
    StepLogRequest,
    manifest_digest,
)
from chaos.security import HANDSHAKE_FAILED_EVENTS, Security, handshake_error

log = logging.getLogger("chaos.replication.pull")

__all__ = [
    "MANIFEST_GRACE_S",
    "NO_KEY",
    "DonorUnreachable",
    "check_timeout",
    "donor_request",
    "fetch_manifest",
    "gather_manifests",
    "latest_manifest",
]

NO_KEY = "CURVE handshake failed: it has no or a different cluster key"

# ----------------------------------------------------------------------------- joiner


def _await_reply(sock: zmq.Socket, mon: zmq.Socket, address: str, timeout_s: float) -> list[bytes]:
    """The donor's reply on ``sock``, unless its address refuses the connection first
    (``mon`` reports a connect retry, or a failed CURVE handshake).

    Raises:
        ChaosTimeout: no reply within ``timeout_s``.
        DonorUnreachable: the donor's address refused the connection, or its handshake.
    """
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(mon, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        ready = dict(poller.poll(max(1, int(left * 1000))))
        if sock in ready:
            return sock.recv_multipart()
        event = recv_monitor_message(mon)["event"] if mon in ready else None
        if event is not None and handshake_error(event) is not None:
            raise DonorUnreachable(f"donor {address} refused the connection: {NO_KEY}")
        if event == zmq.EVENT_CONNECT_RETRIED:
            raise DonorUnreachable(f"donor {address} refuses connections: its shard server is gone",
                                   unreachable=(address,))  # fmt: skip
    raise ChaosTimeout(f"donor {address} sent no manifest within {timeout_s} s")


class DonorUnreachable(ReplicationError):
    """A donor's address refuses connections: no shard server listens there any more (the
    donor left or died). A donor's server listens for its trainer's whole life, so the donor is
    gone; it is not asked again."""


def check_timeout(timeout_s: float, name: str = "timeout_s") -> None:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise TypeError(f"{name} must be a number of seconds")
    if not timeout_s > 0:
        raise ValueError(f"{name} must be > 0, got {timeout_s!r}")


def latest_manifest(
    address: str,
    min_epoch: int,
    timeout_s: float,
    *,
    context: zmq.Context | None = None,
    security: Security | None = None,
) -> tuple[bytes, int, int]:
    """Asks one donor for the manifest of whatever it published under ``min_epoch`` or later.

    A joiner uses this: the donors publish at their next step boundary, under the epoch they
    install there, which may be newer than the one that named them.

    Args:
        address: The donor's ``ShardServer.address``.
        min_epoch: The oldest epoch whose snapshot will do.
        timeout_s: How long to wait for the answer, in seconds.
        context: ZeroMQ context (default: the process's shared instance).
        security: The cluster key (default: none, a plain connection).

    Returns:
        ``(manifest, epoch, step)`` of the published snapshot; pull from this donor with them.

    Raises:
        ChaosTimeout: no answer within ``timeout_s``.
        ReplicationError: the donor refused (nothing published, or an older epoch) or answered
            something malformed.
        DonorUnreachable: the donor's address refuses connections, or the CURVE handshake.
    """
    req = ManifestRequest(req_id=1, epoch=min_epoch, step=None, newer_ok=True)
    manifest, head = _manifest_exchange(address, req, timeout_s, context, security)
    return manifest, head.epoch, head.step


def fetch_manifest(
    address: str,
    epoch: int,
    step: int | None,
    timeout_s: float,
    *,
    context: zmq.Context | None = None,
    security: Security | None = None,
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
        security: The cluster key (default: none, a plain connection).

    Returns:
        ``(manifest, step)``: the encoded manifest, checked against the digest in the reply
        header, and the step of the published snapshot (pull with that step).

    Raises:
        ChaosTimeout: no answer within ``timeout_s``.
        ReplicationError: the donor refused (stale snapshot, nothing published) or answered
            something malformed.
    """
    req = ManifestRequest(req_id=1, epoch=epoch, step=step)
    manifest, head = _manifest_exchange(address, req, timeout_s, context, security)
    return manifest, head.step


MANIFEST_GRACE_S = 5.0
"""Once one donor published its snapshot, how long the joiner waits for the other donors."""


def gather_manifests(
    donors: Mapping[str, str],
    epoch: int,
    timeout_s: float,
    poll_interval_s: float,
    *,
    grace_s: float = MANIFEST_GRACE_S,
    security: Security | None = None,
) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """Asks every donor for the snapshot it published at its next step boundary.

    Donors publish under the epoch they install there, which may be newer than the planning
    ``epoch`` and differ between donors; all publish the same step. Once one has answered, the
    others get ``grace_s`` to answer too; the pull then uses those that did (the plan is redone
    without the rest, see :func:`plan_for_snapshot`).

    Args:
        donors: Donor id -> ``ShardServer.address``.
        epoch: The epoch whose policy named the donors.
        timeout_s: Longest wait for the first donor's snapshot, in seconds.
        poll_interval_s: Pause between rounds of asking the donors that have not published.
        grace_s: How long the others get once one donor answered.
        security: The cluster key (default: none, plain connections). A donor that refuses
            its handshake (another key) counts as gone.

    Returns:
        ``(manifest, {donor: (epoch, step)})`` for the donors that published that step.

    Raises:
        ReplicationError: every donor is gone (its address refuses connections) before one
            published: the pull fails at once rather than at ``timeout_s``.
        ChaosTimeout: no donor published within ``timeout_s``.
        ValueError: ``timeout_s`` or ``poll_interval_s`` is not positive.
        TypeError: either is not a number.
    """
    check_timeout(timeout_s)
    check_timeout(poll_interval_s, "poll_interval_s")
    deadline = time.monotonic() + timeout_s
    keys: dict[str, tuple[int, int]] = {}
    gone: dict[str, str] = {}  # donors whose address refuses connections: never asked again
    refused: list[str] = []  # their addresses
    manifest = b""
    last: Exception | None = None
    while time.monotonic() < deadline and len(keys) + len(gone) < len(donors):
        for nid, address in donors.items():
            if nid in keys or nid in gone:
                continue
            try:
                got, e, s = latest_manifest(address, epoch, timeout_s=2.0, security=security)
            except DonorUnreachable as exc:
                gone[nid], last = "unreachable", exc
                refused.extend(exc.unreachable)
                continue
            except (ReplicationError, ChaosTimeout) as exc:
                last = exc
                continue
            if not keys:
                manifest = got
                deadline = min(deadline, time.monotonic() + grace_s)
            if s == next(iter(keys.values()), (e, s))[1] and got == manifest:
                keys[nid] = (e, s)
        if len(gone) == len(donors):
            raise ReplicationError(
                f"no donor left to pull the state from: every donor of epoch {epoch} is gone "
                f"({last})",
                gone,
                unreachable=tuple(refused),
            )
        if len(keys) + len(gone) < len(donors):
            time.sleep(poll_interval_s)  # donors publish at their step boundary
    if not keys:
        raise ChaosTimeout(f"no donor published its state for epoch {epoch}: {last}")
    return manifest, keys


def donor_request(
    address: str,
    req: ManifestRequest | StepLogRequest,
    timeout_s: float,
    *,
    context: zmq.Context | None = None,
    security: Security | None = None,
    what: str = "manifest",
) -> tuple[Reply, list[bytes]]:
    """Sends one request to a donor's shard server and reads its reply: the decoded header and
    every frame (the header first).

    Raises:
        ChaosTimeout: no reply within ``timeout_s``.
        DonorUnreachable: the donor's address refuses connections, or the CURVE handshake.
        ReplicationError: the donor refused (``what`` names the request) or sent a header that
            cannot be read.
    """
    check_timeout(timeout_s)
    ctx = context or zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if security is not None:
        security.client(sock)
    mon = sock.get_monitor_socket(zmq.EVENT_CONNECT_RETRIED | HANDSHAKE_FAILED_EVENTS)
    try:
        sock.connect(address)
        sock.send(WIRE_ENCODER.encode(req))
        frames = _await_reply(sock, mon, address, timeout_s)
    finally:
        sock.disable_monitor()
        mon.close(linger=0)
        sock.close(linger=0)
    try:
        head = REPLY_DECODER.decode(frames[0])
    except msgspec.DecodeError as exc:
        raise ReplicationError(f"donor {address} sent a malformed reply: {exc}") from exc
    if isinstance(head, Refusal):
        raise ReplicationError(f"donor {address} refused the {what}: {head.reason}: {head.detail}")
    return head, frames


def _manifest_exchange(
    address: str,
    req: ManifestRequest,
    timeout_s: float,
    context: zmq.Context | None,
    security: Security | None = None,
) -> tuple[bytes, ManifestReply]:
    head, frames = donor_request(address, req, timeout_s, context=context, security=security)
    if not isinstance(head, ManifestReply) or len(frames) != 2:
        raise ReplicationError(f"donor {address} answered a manifest request with {head!r}")
    if manifest_digest(frames[1]) != head.digest:
        raise ReplicationError(f"donor {address} sent a manifest that fails its digest")
    return frames[1], head
