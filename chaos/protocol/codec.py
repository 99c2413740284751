"""Encoding, decoding and the one check of every untrusted control-plane frame.

:func:`validate` turns every bad frame into a :class:`~chaos.protocol.messages.Refusal` with a
reason code instead of raising; :func:`decode` is for frames of a trusted shape (a reply the CLI
awaits) and raises :class:`~chaos.errors.ProtocolError`.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from chaos.errors import ProtocolError
from chaos.protocol.messages import (
    DEFAULT_MAX_FRAME_BYTES,
    MAX_EPOCH_JUMP,
    MAX_TERM_JUMP,
    BulkData,
    JoinRequest,
    Message,
    Reason,
    Refusal,
    TrainerEventBase,
    TrainerInfo,
    TrainerRegister,
    _Base,
)
from chaos.wire import PROTOCOL_VERSION

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


class _Envelope(msgspec.Struct):
    """Loose first pass: just enough to tell a wrong version from garbage."""

    v: int = -1


_ENVELOPE_DECODER = msgspec.msgpack.Decoder(_Envelope)


def encode(msg: Message) -> bytes:
    """Encodes one message as msgpack.

    Args:
        msg: Any member of :data:`Message`.

    Returns:
        The frame.

    Raises:
        ProtocolError: ``msg`` is not a protocol message.
    """
    if not isinstance(msg, _Base):
        raise ProtocolError(f"not a protocol message: {type(msg).__name__}")
    return _ENCODER.encode(msg)


def decode(frame: bytes, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Message:
    """Decodes a trusted-shape frame (e.g. a reply the CLI awaits), raising on bad input.

    Args:
        frame: The msgpack frame.
        max_frame_bytes: Reject frames longer than this.

    Returns:
        The message.

    Raises:
        ProtocolError: too large, wrong version or malformed.
    """
    result = _decode_checked(frame, max_frame_bytes)
    if isinstance(result, tuple):
        raise ProtocolError(f"{result[0].value}: {result[1]}")
    return result


def _decode_checked(frame: bytes, max_frame_bytes: int) -> Message | tuple[Reason, str]:
    if len(frame) > max_frame_bytes:
        return Reason.TOO_LARGE, f"{len(frame)} bytes > {max_frame_bytes}"
    # Any exception is bad input, not only msgspec's own: a frame of a few thousand nested
    # arrays raises RecursionError, a huge integer OverflowError, and so on.
    try:
        env = _ENVELOPE_DECODER.decode(frame)
    except Exception as exc:  # noqa: BLE001 - untrusted input must never raise
        return Reason.MALFORMED, _why(exc)
    if env.v != PROTOCOL_VERSION:  # also a frame without a version (the full decode's default)
        return Reason.BAD_VERSION, f"version {env.v}, expected {PROTOCOL_VERSION}"
    try:
        return _DECODER.decode(frame)
    except Exception as exc:  # noqa: BLE001 - untrusted input must never raise
        return Reason.MALFORMED, _why(exc)


def _why(exc: BaseException) -> str:
    """A short description of a decode error (its type when it is not msgspec's own)."""
    if isinstance(exc, (msgspec.DecodeError, msgspec.ValidationError)):
        return str(exc)[:200]
    return f"{type(exc).__name__}: {exc}"[:200]


@dataclass(frozen=True)
class ValidationContext:
    """What the receiver knows when it checks a frame.

    Args:
        max_frame_bytes: Frame size cap.
        epoch: The receiver's membership epoch.
        term: The receiver's election term.
        members: The receiver's current membership.
        is_scheduler: Whether the receiver is the scheduler.
        paused: Whether the receiver pauses (no majority / no scheduler).
        joining: Whether the receiver is still joining (it then accepts the term of the
            scheduler that admits it).
        node_id: The receiver's own id, for refusals.
    """

    max_frame_bytes: int
    epoch: int
    term: int
    members: frozenset[str]
    is_scheduler: bool
    paused: bool
    joining: bool
    node_id: str = ""


def refusal(
    reason: Reason, ctx: ValidationContext, detail: str = "", ref_type: str = ""
) -> Refusal:
    """Builds a refusal stamped with the receiver's identity, epoch and term.

    Args:
        reason: The reason code.
        ctx: The receiver's context.
        detail: Human-readable detail (truncated to 1024 characters).
        ref_type: The refused message's type tag, when known.

    Returns:
        The refusal.
    """
    return Refusal(
        sender=ctx.node_id,
        epoch=ctx.epoch,
        reason=reason,
        detail=detail[:1024],
        ref_type=ref_type[:64],
        term=ctx.term,
    )


def tag_of(msg: Message) -> str:
    """Returns the wire tag of a message (e.g. ``"ping"``)."""
    return str(type(msg).__struct_config__.tag)


@dataclass(frozen=True)
class Rejected:
    """The result of :func:`validate` for a refused frame.

    Args:
        refusal: The refusal to answer with (or to count when the frame is dropped).
    """

    refusal: Refusal


def validate(
    frame: bytes, ctx: ValidationContext, attachment: bytes | memoryview | None = None
) -> Message | Rejected:
    """The single validation point: decodes ``frame`` and applies the semantic checks.

    Never raises, whatever the input: an unexpected exception while checking a frame refuses it
    as ``malformed``.

    Args:
        frame: The raw frame.
        ctx: The receiver's context.
        attachment: The raw frame that followed it, if any (only a :class:`BulkData` has one).

    Returns:
        The decoded message, or :class:`Rejected` with a refusal that says why.
    """
    try:
        return _validate(frame, ctx, attachment)
    except Exception as exc:  # noqa: BLE001 - untrusted input must never raise
        return Rejected(refusal(Reason.MALFORMED, ctx, _why(exc)))


def _validate(
    frame: bytes, ctx: ValidationContext, attachment: bytes | memoryview | None
) -> Message | Rejected:
    result = _decode_checked(frame, ctx.max_frame_bytes)
    if isinstance(result, tuple):
        return Rejected(refusal(result[0], ctx, result[1]))
    msg = result
    tag = tag_of(msg)
    wrong = _attachment_problem(msg, attachment, ctx.max_frame_bytes)
    if wrong is not None:
        return Rejected(refusal(wrong[0], ctx, wrong[1], tag))
    kind, to_scheduler = kind_of(msg)
    term = getattr(msg, "term", None)
    if kind in ("command", "scheduler") and not msg.sender:
        return Rejected(refusal(Reason.MALFORMED, ctx, "a scheduler message without sender", tag))
    if kind == "peer" and msg.sender not in ctx.members:
        return Rejected(refusal(Reason.UNKNOWN_PEER, ctx, f"{msg.sender!r}", tag))
    ahead = _far_ahead(msg, kind, term, ctx)
    if ahead:
        return Rejected(refusal(Reason.BAD_REQUEST, ctx, ahead, tag))
    stale_term = term is not None and term < ctx.term and not ctx.joining
    if kind in ("command", "scheduler") and stale_term:
        return Rejected(refusal(Reason.STALE_TERM, ctx, f"term {term} < {ctx.term}", tag))
    if kind == "command" and msg.epoch < ctx.epoch and not ctx.joining:
        return Rejected(refusal(Reason.STALE_EPOCH, ctx, f"epoch {msg.epoch} < {ctx.epoch}", tag))
    if to_scheduler and not isinstance(msg, JoinRequest):
        if not ctx.is_scheduler:
            return Rejected(refusal(Reason.NOT_SCHEDULER, ctx, "", tag))
        if ctx.paused:
            return Rejected(refusal(Reason.PAUSED, ctx, "no majority", tag))
    if type(msg).MUTATING and ctx.paused:
        return Rejected(refusal(Reason.PAUSED, ctx, "no scheduler with a majority", tag))
    bad = _trainer_problem(msg) or _refusal_problem(msg)
    if bad:
        return Rejected(refusal(Reason.BAD_REQUEST, ctx, bad, tag))
    return msg


def _far_ahead(msg: Message, kind: str, term: int | None, ctx: ValidationContext) -> str:
    """A member's or scheduler's term or epoch too far ahead of the receiver's own (see
    :data:`~chaos.protocol.messages.MAX_TERM_JUMP`); a joiner takes the cluster's as it is."""
    if ctx.joining or kind not in ("command", "scheduler", "peer"):
        return ""
    if term is not None and term > ctx.term + MAX_TERM_JUMP:
        return f"term {term} too far ahead of {ctx.term}"
    if msg.epoch > ctx.epoch + MAX_EPOCH_JUMP:
        return f"epoch {msg.epoch} too far ahead of {ctx.epoch}"
    return ""


def kind_of(msg: Message) -> tuple[str, bool]:
    """The ``(KIND, TO_SCHEDULER)`` that apply to ``msg``.

    A trainer event (:class:`~chaos.protocol.messages.TrainerEventBase`) with ``node_id`` set
    was forwarded by a member's daemon: it is then a peer message to the scheduler; without, it
    is a trainer's client message.
    """
    if isinstance(msg, TrainerEventBase) and msg.node_id is not None:
        return "peer", True
    return type(msg).KIND, type(msg).TO_SCHEDULER


def _attachment_problem(
    msg: Message, attachment: bytes | memoryview | None, max_frame_bytes: int
) -> tuple[Reason, str] | None:
    """A :class:`BulkData` must come with an attachment of its declared size; nothing else may."""
    if not isinstance(msg, BulkData):
        if attachment is not None:
            return Reason.MALFORMED, f"unexpected attachment of {len(attachment)} bytes"
        return None
    if msg.size > max_frame_bytes:
        return Reason.TOO_LARGE, f"attachment of {msg.size} bytes > {max_frame_bytes}"
    if attachment is None:
        return Reason.MALFORMED, "bulk data without its attachment"
    if len(attachment) != msg.size:
        return Reason.MALFORMED, f"attachment of {len(attachment)} bytes, declared {msg.size}"
    return None


def _refusal_problem(msg: Message) -> str:
    """A refusal may suggest other members (``members``), each once, or name a joiner
    (``joiner``) only when it refuses a join."""
    if not isinstance(msg, Refusal) or not (msg.members or msg.joiner is not None):
        return ""
    if msg.ref_type != "join_request":
        what = "members suggested" if msg.members else "a joiner named"
        return f"{what} in a refusal of {msg.ref_type or 'an unnamed message'!r}"
    if len(set(msg.members)) != len(msg.members):
        return "members lists an address twice"
    return ""


def _trainer_problem(msg: Message) -> str:
    """Semantic checks of the trainer messages beyond their schema ("" when fine)."""
    if isinstance(msg, (TrainerInfo, TrainerEventBase)) and msg.node_id not in (None, msg.sender):
        return f"node_id {msg.node_id!r} differs from the sender {msg.sender!r}"
    if isinstance(msg, (TrainerRegister, TrainerInfo)):
        if msg.tensor_sizes is not None and sum(msg.tensor_sizes) <= 0:
            return "tensor_sizes describe an empty state"
    return ""
