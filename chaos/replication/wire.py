"""Wire messages of state replication (see :mod:`chaos.replication.pull`).

Every message is a typed, versioned msgspec schema (tag field ``"type"``), msgpack-encoded, never
pickled. Requests are one frame; a :class:`ManifestReply` or :class:`ShardReply` header frame is
followed by one payload frame. Untrusted requests are checked in one place,
:func:`validate_request`, which returns a :class:`~chaos.protocol.messages.Refusal` (the one refusal
of every msgpack channel, with a :class:`~chaos.protocol.messages.Reason` code) instead of raising.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Annotated, Union

import msgspec

from chaos.protocol.messages import MAX_COUNTER, Reason, Refusal
from chaos.wire import REPLICATION_VERSION

__all__ = [
    "MAX_REQUEST_BYTES",
    "ManifestReply",
    "ManifestRequest",
    "ShardReply",
    "ShardRequest",
    "StepEntry",
    "StepLogReply",
    "StepLogRequest",
    "manifest_digest",
    "shard_checksum",
    "validate_request",
]


MAX_REQUEST_BYTES = 4096
"""Largest request frame a server decodes; anything bigger is refused as ``too_large``."""


def shard_checksum(data: bytes | bytearray | memoryview) -> int:
    """The checksum every shard carries (:func:`chaos.ops.checksum`, 64-bit)."""
    from chaos.ops import checksum  # imported lazily: chaos.ops may JIT-build native code

    return checksum(data)


def manifest_digest(manifest_bytes: bytes | memoryview) -> str:
    """SHA-256 (hex) of an encoded manifest; requests carry it so that every donor serves the
    same state (same layout, hyperparameters, optimizer values and runtime record length)."""
    return hashlib.sha256(manifest_bytes).hexdigest()


# ----------------------------------------------------------------------------- messages

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Counter = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNTER)]
"""An epoch or a step, bounded like the control plane's
(:data:`~chaos.protocol.messages.MAX_COUNTER`)."""
Hex = Annotated[str, msgspec.Meta(max_length=64)]


class WireMessage(msgspec.Struct, kw_only=True, frozen=True, tag_field="type"):
    v: int = REPLICATION_VERSION
    req_id: NonNeg = 0


class ManifestRequest(WireMessage, frozen=True, tag="manifest_req"):
    """Asks for the encoded manifest of the state published for ``(epoch, step)``; ``step``
    ``None`` accepts whatever step is published for ``epoch`` (the reply names it).
    ``newer_ok`` also accepts a snapshot published under a later epoch (a donor may install a
    newer policy than the one that named it before it publishes); the reply names its epoch."""

    epoch: Counter
    step: Counter | None = None
    newer_ok: bool = False


class ShardRequest(WireMessage, frozen=True, tag="shard_req"):
    """Asks for bytes ``[offset, offset + length)`` of the state published for ``(epoch, step)``.

    ``fingerprint`` and ``digest`` are the joiner's layout fingerprint and manifest digest; a
    donor whose state differs refuses instead of sending bytes of another layout.
    """

    epoch: Counter
    step: Counter
    fingerprint: Hex
    digest: Hex
    offset: NonNeg
    length: NonNeg


class ManifestReply(WireMessage, frozen=True, tag="manifest"):
    """Header of a manifest reply; the next frame is the encoded manifest."""

    epoch: Counter
    step: Counter
    digest: Hex


class ShardReply(WireMessage, frozen=True, tag="shard"):
    """Header of a shard reply; the next frame is the payload of ``length`` bytes.

    ``epoch`` and ``step`` echo the request's: a snapshot served as the state of several
    epochs answers each joiner under the epoch it asked for."""

    epoch: Counter
    step: Counter
    offset: NonNeg
    length: NonNeg
    checksum: NonNeg


MAX_LOG_ENTRIES = 64
"""Most steps one :class:`StepLogRequest` may ask for."""


class StepLogRequest(WireMessage, frozen=True, tag="steplog_req"):
    """A catching-up joiner asks for the logged steps from ``from_step`` on (at most
    ``max_entries``; the reply may hold fewer, see :class:`StepLogReply`)."""

    from_step: Counter
    max_entries: Annotated[int, msgspec.Meta(ge=1, le=MAX_LOG_ENTRIES)] = 8


class StepEntry(msgspec.Struct, kw_only=True, frozen=True):
    """One logged step: the allreduce's result of ``step`` (its payload frame: ``nbytes``
    bytes, the gradient buffer a member installs, weight last) and the optimizer's
    hyperparameters that step ran with (msgpack of its param groups without ``params``)."""

    step: Counter
    nbytes: NonNeg
    hypers: Annotated[bytes, msgspec.Meta(max_length=65536)]


class StepLogReply(WireMessage, frozen=True, tag="steplog"):
    """Header of a step-log reply; one payload frame per entry follows.

    ``head`` is the step the log would log next (entries exist for ``[start, head)``);
    ``closed_at`` the step at which the donor put the joiner into its data plane (it logs no
    further: the joiner replays up to that step, then pulls what still differs)."""

    start: Counter
    head: Counter
    closed_at: Counter | None = None
    stopped: bool = False
    """The donor stopped logging before the joiner entered (its log reached its byte limit, or
    it skipped a step): the joiner stops replaying and pulls what differs when it enters."""
    entries: list[StepEntry] = []


Request = Union[ManifestRequest, ShardRequest, StepLogRequest]
Reply = Union[ManifestReply, ShardReply, StepLogReply, Refusal]

UNREADABLE: tuple[type[Exception], ...] = (msgspec.DecodeError, RecursionError, UnicodeDecodeError)
"""What msgspec raises on bytes it cannot read: malformed or mistyped msgpack, nesting deeper
than its recursion limit, a string that is not UTF-8."""


class ReplyDecoder:
    """Decodes a shard server's reply header; every way bytes can be unreadable is one
    :class:`msgspec.DecodeError`."""

    def __init__(self) -> None:
        self._decoder = msgspec.msgpack.Decoder(Reply)

    def decode(self, buf: bytes | bytearray | memoryview) -> Reply:
        """Decodes one reply header.

        Raises:
            msgspec.DecodeError: malformed, of another schema, nested too deep or not UTF-8.
        """
        try:
            return self._decoder.decode(buf)
        except (RecursionError, UnicodeDecodeError) as exc:
            raise msgspec.DecodeError(f"unreadable reply: {exc}") from exc


WIRE_ENCODER = msgspec.msgpack.Encoder()
REPLY_DECODER = ReplyDecoder()


def refusal(req_id: int, reason: Reason, detail: str) -> Refusal:
    """The refusal a shard server answers a request with.

    Args:
        req_id: The refused request's id (0 when it could not be read).
        reason: Why.
        detail: In words (cut to 1,024 characters).

    Returns:
        The control plane's :class:`~chaos.protocol.messages.Refusal`, stamped with this wire's
        version.
    """
    return Refusal(v=REPLICATION_VERSION, req_id=req_id, reason=reason, detail=detail[:1024])


def validate_request(frames: Sequence[bytes]) -> Request | Refusal:
    """The one place where request frames (after the routing id) are checked.

    Returns:
        The decoded request, or a :class:`Refusal` saying why it is refused (never raises).
    """
    if len(frames) != 1:
        return refusal(0, Reason.MALFORMED, f"expected 1 request frame, got {len(frames)}")
    body = frames[0]
    if len(body) > MAX_REQUEST_BYTES:
        return refusal(0, Reason.TOO_LARGE, f"request of {len(body)} bytes")
    try:
        raw = msgspec.msgpack.decode(body)
    except UNREADABLE as exc:
        return refusal(0, Reason.MALFORMED, f"not msgpack: {exc}")
    if not isinstance(raw, dict):
        return refusal(0, Reason.MALFORMED, "request is not a map")
    req_id = raw.get("req_id", 0)
    ok_id = isinstance(req_id, int) and not isinstance(req_id, bool) and 0 <= req_id < 1 << 63
    req_id = req_id if ok_id else 0  # a bool would be encoded as a bool: unreadable to the joiner
    if raw.get("v") != REPLICATION_VERSION:
        return refusal(
            req_id, Reason.BAD_VERSION, f"version {raw.get('v')!r}, want {REPLICATION_VERSION}"
        )
    try:
        return msgspec.convert(raw, Request)
    except (msgspec.ValidationError, RecursionError) as exc:
        return refusal(req_id, Reason.MALFORMED, str(exc))
