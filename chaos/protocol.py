"""The daemon's wire protocol: every message once, as a typed, versioned msgspec schema.

Every message is a :class:`msgspec.Struct` of the tagged union :data:`Message` (tag field
``"type"``), encoded with msgpack. Each one carries the protocol version ``v``, the ``sender``'s
node id and the sender's membership ``epoch``; messages that belong to an election term also carry
``term``. Nothing is ever pickled.

All untrusted input goes through one function, :func:`validate`, which turns every bad frame into a
:class:`Refusal` with a reason code from :class:`Reason` instead of raising. The daemon answers a
refusal (or drops and counts the frame) and keeps running.

Message kinds (the ``KIND`` class variable) decide which semantic checks apply:

* ``"peer"``: sent by a cluster member; refused with ``unknown_peer`` when the sender is not in
  the receiver's membership.
* ``"command"``: sent by the scheduler to members; refused with ``stale_term`` or
  ``stale_epoch`` when older than the receiver's term or epoch.
* ``"leader"``: the scheduler's heartbeat; refused with ``stale_term`` only (it is how members
  discover a newly elected scheduler).
* ``"open"``: joins, probes, replies and refusals; accepted from anyone.
* ``"client"``: the local CLI and the training process; not epoch-checked.

Messages with ``TO_SCHEDULER = True`` are refused with ``not_scheduler`` by a non-scheduler
(joins are forwarded instead), and with ``paused`` by a scheduler without a majority.

:class:`TrainerEvent` is the one message with two kinds: sent by the trainer to its local daemon
it is a ``"client"`` message (``node_id`` unset); forwarded by that daemon to the scheduler (with
``node_id`` set to the forwarding daemon's id) it is a ``"peer"`` message with
``TO_SCHEDULER = True``. :func:`kind_of` tells them apart.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal, Union

import msgspec

from chaos.errors import ProtocolError

PROTOCOL_VERSION = 2
"""Bumped on every incompatible change of any schema below."""

DEFAULT_MAX_FRAME_BYTES = 1 << 20
"""Default cap on one encoded frame (1 MiB); bandwidth-probe chunks must fit below it."""

NodeId = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
Address = Annotated[str, msgspec.Meta(min_length=6, max_length=256, pattern=r"^tcp://[^\s]+:\d+$")]
Endpoint = Annotated[
    str,
    msgspec.Meta(min_length=7, max_length=256, pattern=r"^(tcp://[^\s]+:\d+|ipc://[^\s]+)$"),
]
"""A trainer's data-plane endpoint (allreduce or shard server): ``tcp://HOST:PORT`` or
``ipc://PATH``."""
OpId = Annotated[str, msgspec.Meta(max_length=64)]
StateDigest = Annotated[str, msgspec.Meta(max_length=64, pattern=r"^[0-9a-f]*$")]
"""Hex SHA-256 of a restored training state (stop-resume); empty: not a restored state."""
Detail = Annotated[str, msgspec.Meta(max_length=1024)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0)]

MAX_STATE_TENSORS = 32_768
"""Most tensors a training state layout may list (keeps a ClusterUpdate well below 1 MiB)."""

TensorSizes = Annotated[list[NonNeg], msgspec.Meta(max_length=MAX_STATE_TENSORS)]
"""Byte size of every tensor of the training state, in canonical stream order."""


class Reason(str, enum.Enum):
    """Reason codes of a :class:`Refusal` (and of a failed :class:`OpResult`)."""

    BAD_VERSION = "bad_version"
    STALE_EPOCH = "stale_epoch"
    STALE_TERM = "stale_term"
    UNKNOWN_PEER = "unknown_peer"
    MALFORMED = "malformed"
    TOO_LARGE = "too_large"
    NOT_SCHEDULER = "not_scheduler"
    PAUSED = "paused"
    DUPLICATE_ID = "duplicate_id"
    UNREACHABLE = "unreachable"
    WOULD_DISCONNECT = "would_disconnect"
    BAD_REQUEST = "bad_request"
    TIMEOUT = "timeout"
    NO_STATE_SOURCE = "no_state_source"
    STATE_CONFLICT = "state_conflict"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return self.value.__format__(spec)


NodeStateName = Literal["joining", "active", "leaving", "failed"]
ApplyAt = Literal["after_allreduce", "before_next_allreduce"]
FaultName = Literal["drop_to", "drop_from", "cut_link", "partition", "clear"]
TrainerStateName = Literal["none", "syncing", "training"]
TrainerEventKind = Literal["ready", "replication_done", "step_failed"]


class _Base(msgspec.Struct, kw_only=True, frozen=True, tag_field="type"):
    """Fields every message carries."""

    KIND: ClassVar[str] = "open"
    TO_SCHEDULER: ClassVar[bool] = False
    MUTATING: ClassVar[bool] = False

    v: int = PROTOCOL_VERSION
    sender: Annotated[str, msgspec.Meta(max_length=64)] = ""
    epoch: NonNeg = 0


# ----------------------------------------------------------------------------- shared structs


class Resources(msgspec.Struct, kw_only=True, frozen=True):
    """A node's local resources, sampled with psutil."""

    cpu_percent: float = 0.0
    memory_percent: float = 0.0
    memory_available_bytes: NonNeg = 0
    battery_percent: float | None = None


class NodeInfo(msgspec.Struct, kw_only=True, frozen=True):
    """One node of the cluster view."""

    id: NodeId
    address: Address
    state: NodeStateName
    joined_at: float
    neighbors: list[NodeId] = []
    resources: Resources | None = None
    data_address: Endpoint | None = None
    shard_address: Endpoint | None = None
    trainer: TrainerStateName = "none"


class LinkInfo(msgspec.Struct, kw_only=True, frozen=True):
    """One overlay link of the cluster view (``None``: not measured yet)."""

    a: NodeId
    b: NodeId
    bandwidth_bps: float | None = None
    latency_s: float | None = None
    tau_sync_s: float | None = None
    up: bool = True


class SyncPolicyWire(msgspec.Struct, kw_only=True, frozen=True):
    """The model synchronization policy (see :mod:`chaos.scheduling.sync_policy`)."""

    kind: Literal["tree", "ring", "single"]
    nodes: list[NodeId]
    root: NodeId | None = None
    parents: dict[NodeId, NodeId | None] = {}
    ring: list[NodeId] = []
    bottleneck_bps: float = 0.0
    est_time_s: float = 0.0
    connected: bool = True
    addresses: dict[NodeId, str] = {}
    """Data-plane endpoint of every node in the policy."""
    topology_epoch: NonNeg = 0
    """The epoch in which this data-plane structure (kind, nodes, tree or ring, endpoints) was
    first issued; allreduce frames carry it. A commit that leaves the structure as it was and
    restarts no allreduce (a link that no tree or ring uses, a node's trainer becoming ready)
    carries it over, so trainers switch epochs without disturbing a round. 0: the epoch of the
    update that carries the policy (older schedulers)."""


class DonorLink(msgspec.Struct, kw_only=True, frozen=True):
    """A donor's link parameters as planned (mirrors ``chaos.scheduling.Neighbor``)."""

    id: NodeId
    prop_s: Seconds
    trans_s_per_byte: Annotated[float, msgspec.Meta(gt=0.0)]
    sync_s: Seconds = 0.0


class ReplicationWire(msgspec.Struct, kw_only=True, frozen=True):
    """The state replication policy for one joiner (``skipped`` names why there is none).

    ``donor_addresses`` are the donors' shard-server endpoints, ``donors`` their planned link
    parameters (the joiner re-plans with them when a donor dies) and ``tensor_sizes`` the layout
    that was planned. ``method`` is the planner the scheduler used (from its replication
    strategy); a joiner that must re-plan uses the same one over the same donors.
    """

    target: NodeId
    shard_size: NonNeg = 0
    assignment: dict[NodeId, list[tuple[int, int]]] = {}
    makespan_s: float = 0.0
    skipped: str = ""
    donor_addresses: dict[NodeId, str] = {}
    donors: list[DonorLink] = []
    tensor_sizes: list[int] = []
    method: Literal["chaos", "scan", "even", "single-source"] = "chaos"


class ClusterView(msgspec.Struct, kw_only=True, frozen=True):
    """The scheduler's cluster view at one epoch."""

    epoch: NonNeg
    term: NonNeg
    scheduler: NodeId | None
    nodes: list[NodeInfo]
    links: list[LinkInfo]


# ----------------------------------------------------------------------------- peer messages


class LeaderHeartbeat(_Base, frozen=True, tag="leader_heartbeat"):
    """Scheduler -> every member, every heartbeat interval."""

    KIND: ClassVar[str] = "leader"
    term: NonNeg


class MemberHeartbeat(_Base, frozen=True, tag="member_heartbeat"):
    """Member -> scheduler, every heartbeat interval, with local resources."""

    KIND: ClassVar[str] = "peer"
    TO_SCHEDULER: ClassVar[bool] = True
    term: NonNeg
    resources: Resources | None = None


class RequestVote(_Base, frozen=True, tag="request_vote"):
    """Candidate -> members (Raft). ``epoch`` is the candidate's view epoch."""

    KIND: ClassVar[str] = "peer"
    term: NonNeg
    transfer: bool = False


class VoteReply(_Base, frozen=True, tag="vote_reply"):
    """Member -> candidate."""

    KIND: ClassVar[str] = "peer"
    term: NonNeg
    granted: bool


class TimeoutNow(_Base, frozen=True, tag="timeout_now"):
    """Leaving scheduler -> chosen successor: start an election now (leadership transfer)."""

    KIND: ClassVar[str] = "command"
    term: NonNeg


class JoinRequest(_Base, frozen=True, tag="join_request"):
    """Joiner -> any member (forwarded to the scheduler): scale-out."""

    TO_SCHEDULER: ClassVar[bool] = True
    node_id: NodeId
    address: Address
    neighbors: Annotated[list[NodeId], msgspec.Meta(max_length=256)] = []
    state_bytes: NonNeg | None = None
    tensor_sizes: Annotated[list[NonNeg], msgspec.Meta(max_length=100_000)] | None = None
    forwarded_by: NodeId | None = None
    op_id: OpId = ""


class LeaveRequest(_Base, frozen=True, tag="leave_request"):
    """Member -> scheduler: scale-in for a graceful leave."""

    KIND: ClassVar[str] = "peer"
    TO_SCHEDULER: ClassVar[bool] = True
    node_id: NodeId
    op_id: OpId = ""


class LinkRequest(_Base, frozen=True, tag="link_request"):
    """Member -> scheduler: connect-link or disconnect-link between ``a`` and ``b``."""

    KIND: ClassVar[str] = "peer"
    TO_SCHEDULER: ClassVar[bool] = True
    a: NodeId
    b: NodeId
    op: Literal["connect", "disconnect"]
    reason: Literal["requested", "probe_failed", "probe_recovered"] = "requested"
    op_id: OpId = ""
    premeasured: bool = False
    """Connect only: ``a`` (the sender) is already pinging ``b`` and sends the
    :class:`LinkReport` itself, with op id ``"pre-" + op_id``, so the scheduler need not order
    the measurement."""


class ConnectCommand(_Base, frozen=True, tag="connect_command"):
    """Scheduler -> member: connect to ``peer`` and measure the link, then send a LinkReport."""

    KIND: ClassVar[str] = "command"
    term: NonNeg
    peer: NodeId
    address: Address
    measure_bandwidth: bool = True
    op_id: OpId = ""


class LinkReport(_Base, frozen=True, tag="link_report"):
    """Member -> scheduler: the measured link from ``sender`` to ``peer``."""

    KIND: ClassVar[str] = "peer"
    TO_SCHEDULER: ClassVar[bool] = True
    term: NonNeg
    peer: NodeId
    up: bool
    latency_s: Seconds | None = None
    bandwidth_bps: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    op_id: OpId = ""


class AgentReport(_Base, frozen=True, tag="agent_report"):
    """Member -> new scheduler after an election: what this agent knows about itself."""

    KIND: ClassVar[str] = "peer"
    TO_SCHEDULER: ClassVar[bool] = True
    term: NonNeg
    address: Address
    joined_at: float
    links: Annotated[list[LinkInfo], msgspec.Meta(max_length=256)] = []
    resources: Resources | None = None
    data_address: Endpoint | None = None
    shard_address: Endpoint | None = None
    trainer: TrainerStateName = "none"
    tensor_sizes: TensorSizes | None = None


class TrainerInfo(_Base, frozen=True, tag="trainer_info"):
    """Local daemon -> scheduler: the trainer of ``node_id`` (= ``sender``) registered."""

    KIND: ClassVar[str] = "peer"
    TO_SCHEDULER: ClassVar[bool] = True
    node_id: NodeId
    data_address: Endpoint
    shard_address: Endpoint
    has_state: bool
    tensor_sizes: TensorSizes | None = None
    op_id: OpId = ""
    state_digest: StateDigest = ""


class ClusterUpdate(_Base, frozen=True, tag="cluster_update"):
    """Scheduler -> every member: the new view and policies, applied at a step boundary."""

    KIND: ClassVar[str] = "command"
    term: NonNeg
    view: ClusterView
    sync: SyncPolicyWire
    replication: ReplicationWire | None = None
    apply_at: ApplyAt = "after_allreduce"
    restart_allreduce: bool = False
    cause: Annotated[str, msgspec.Meta(max_length=64)] = ""
    op_id: OpId = ""


class PolicyAck(_Base, frozen=True, tag="policy_ack"):
    """Member -> scheduler: the policy of ``epoch`` is installed."""

    KIND: ClassVar[str] = "peer"
    TO_SCHEDULER: ClassVar[bool] = True
    term: NonNeg


class Ping(_Base, frozen=True, tag="ping"):
    """Latency probe."""

    seq: NonNeg
    t: float


class Pong(_Base, frozen=True, tag="pong"):
    """Latency probe answer; echoes ``seq`` and ``t``."""

    seq: NonNeg
    t: float


class BulkData(_Base, frozen=True, tag="bulk_data"):
    """One chunk of a timed bulk bandwidth probe.

    The chunk's bytes are not a field: they follow this frame as one raw *attachment* frame of
    exactly ``size`` bytes, sent without copying and never decoded (only counted). This is the
    one message that carries an attachment; :func:`validate` checks that it has one of the
    declared size, and that no other message has one.
    """

    probe_id: OpId
    index: NonNeg
    count: Annotated[int, msgspec.Meta(ge=1)]
    size: Annotated[int, msgspec.Meta(ge=1)]


class BulkAck(_Base, frozen=True, tag="bulk_ack"):
    """Answer to the last chunk of a bulk probe."""

    probe_id: OpId
    received_bytes: NonNeg


class OpResult(_Base, frozen=True, tag="op_result"):
    """The outcome of a primitive, once every member acknowledged its policy (or it failed)."""

    op_id: OpId
    ok: bool
    reason: Reason | None = None
    detail: Detail = ""
    elapsed_s: Seconds = 0.0


class Refusal(_Base, frozen=True, tag="refusal"):
    """A refused message: ``reason`` says why; ``term`` and ``scheduler`` help the sender."""

    reason: Reason
    detail: Detail = ""
    ref_type: Annotated[str, msgspec.Meta(max_length=64)] = ""
    term: NonNeg = 0
    scheduler: NodeId | None = None


# ----------------------------------------------------------------------------- client messages


class StatusRequest(_Base, frozen=True, tag="status_request"):
    """CLI -> daemon."""

    KIND: ClassVar[str] = "client"


class StatusReply(_Base, frozen=True, tag="status_reply"):
    """Daemon -> CLI: the local node's state and its copy of the cluster view."""

    node_id: NodeId
    role: Literal["follower", "candidate", "scheduler"]
    state: Annotated[str, msgspec.Meta(max_length=32)]
    paused: bool
    scheduler: NodeId | None
    term: NonNeg
    nodes: list[NodeInfo]
    links: list[LinkInfo]
    sync: SyncPolicyWire | None = None


class LeaveCommand(_Base, frozen=True, tag="leave_command"):
    """CLI -> daemon: leave the cluster gracefully (scale-in), then exit."""

    KIND: ClassVar[str] = "client"
    MUTATING: ClassVar[bool] = True


class LinkCommand(_Base, frozen=True, tag="link_command"):
    """CLI -> daemon: add or remove the overlay link to ``peer``."""

    KIND: ClassVar[str] = "client"
    MUTATING: ClassVar[bool] = True
    peer: NodeId
    op: Literal["connect", "disconnect"]


class FaultCommand(_Base, frozen=True, tag="fault_command"):
    """CLI/tests -> daemon: inject a named transport fault (``clear`` removes them all)."""

    KIND: ClassVar[str] = "client"
    name: FaultName
    peers: Annotated[list[NodeId], msgspec.Meta(max_length=256)] = []


class FaultReply(_Base, frozen=True, tag="fault_reply"):
    """Daemon -> CLI: the faults now active, as readable strings."""

    active: list[str]


class PolicyRequest(_Base, frozen=True, tag="policy_request"):
    """Trainer -> daemon: the current policies and step-boundary rule."""

    KIND: ClassVar[str] = "client"


class TrainerRegister(_Base, frozen=True, tag="trainer_register"):
    """Trainer -> local daemon: this node now has a training process (data-plane member).

    ``has_state``: the trainer holds a live training state (the first trainer, or a
    re-registration with new ``tensor_sizes``); ``False``: it must receive the state by
    replication. ``state_digest``: set by trainers restored from one checkpoint (stop-resume);
    a restored trainer whose digest equals the first trainer's joins without replication.
    The daemon answers with an :class:`OpResult` (``epoch``: the epoch whose policy
    includes the trainer).
    """

    KIND: ClassVar[str] = "client"
    MUTATING: ClassVar[bool] = True
    data_address: Endpoint
    shard_address: Endpoint
    has_state: bool
    tensor_sizes: TensorSizes | None = None
    state_digest: StateDigest = ""
    op_id: OpId = ""


class TrainerEvent(_Base, frozen=True, tag="trainer_event"):
    """Trainer -> local daemon (``node_id`` unset) -> scheduler (``node_id`` = ``sender``).

    ``ready``: the trainer holds the state and takes part in training. Answered with an
    :class:`OpResult`.
    """

    KIND: ClassVar[str] = "client"
    kind: TrainerEventKind
    node_id: NodeId | None = None
    elapsed_s: Seconds = 0.0
    detail: Detail = ""
    op_id: OpId = ""


class PolicyReply(_Base, frozen=True, tag="policy_reply"):
    """Daemon -> trainer (``epoch`` is the policy's epoch)."""

    term: NonNeg
    members: list[NodeId]
    sync: SyncPolicyWire | None
    replication: ReplicationWire | None = None
    apply_at: ApplyAt = "after_allreduce"
    restart_allreduce: bool = False
    paused: bool = False
    notify_address: Endpoint | None = None
    notify_interval_s: Seconds = 0.0
    """The longest gap between two notices at ``notify_address`` (0: not said)."""


class PolicyNotice(_Base, frozen=True, tag="policy_notice"):
    """Daemon -> its trainers, published on ``PolicyReply.notify_address`` (``epoch``: the
    installed epoch).

    Sent when the epoch or ``paused`` changes, and at least every ``interval_s`` otherwise, so
    a trainer learns of a newer policy without asking at every step boundary, and can tell a
    silent notifier (then it asks again at every boundary).
    """

    KIND: ClassVar[str] = "client"
    paused: bool = False
    interval_s: Seconds = 0.0
    policy: PolicyReply | None = None
    """The policy of ``epoch``, carried by the notice of a change when it is small (a trainer
    then installs it without asking); ``None`` in the periodic notices."""


Message = Union[
    LeaderHeartbeat,
    MemberHeartbeat,
    RequestVote,
    VoteReply,
    TimeoutNow,
    JoinRequest,
    LeaveRequest,
    LinkRequest,
    ConnectCommand,
    LinkReport,
    AgentReport,
    ClusterUpdate,
    PolicyAck,
    Ping,
    Pong,
    BulkData,
    BulkAck,
    OpResult,
    Refusal,
    StatusRequest,
    StatusReply,
    LeaveCommand,
    LinkCommand,
    FaultCommand,
    FaultReply,
    PolicyRequest,
    PolicyReply,
    PolicyNotice,
    TrainerRegister,
    TrainerInfo,
    TrainerEvent,
]

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
    try:
        env = _ENVELOPE_DECODER.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return Reason.MALFORMED, str(exc)[:200]
    if env.v != PROTOCOL_VERSION:  # also a frame without a version (the full decode's default)
        return Reason.BAD_VERSION, f"version {env.v}, expected {PROTOCOL_VERSION}"
    try:
        return _DECODER.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return Reason.MALFORMED, str(exc)[:200]


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

    Never raises on bad input.

    Args:
        frame: The raw frame.
        ctx: The receiver's context.
        attachment: The raw frame that followed it, if any (only a :class:`BulkData` has one).

    Returns:
        The decoded message, or :class:`Rejected` with a refusal that says why.
    """
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
    if kind in ("command", "leader") and not msg.sender:
        return Rejected(refusal(Reason.MALFORMED, ctx, "a scheduler message without sender", tag))
    if kind == "peer" and msg.sender not in ctx.members:
        return Rejected(refusal(Reason.UNKNOWN_PEER, ctx, f"{msg.sender!r}", tag))
    if kind in ("command", "leader") and term is not None and term < ctx.term and not ctx.joining:
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
    bad = _trainer_problem(msg)
    if bad:
        return Rejected(refusal(Reason.BAD_REQUEST, ctx, bad, tag))
    return msg


def kind_of(msg: Message) -> tuple[str, bool]:
    """The ``(KIND, TO_SCHEDULER)`` that apply to ``msg``.

    A :class:`TrainerEvent` with ``node_id`` set was forwarded by a member's daemon: it is then a
    peer message to the scheduler; without, it is a trainer's client message.
    """
    if isinstance(msg, TrainerEvent) and msg.node_id is not None:
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


def _trainer_problem(msg: Message) -> str:
    """Semantic checks of the trainer messages beyond their schema ("" when fine)."""
    if isinstance(msg, (TrainerInfo, TrainerEvent)) and msg.node_id not in (None, msg.sender):
        return f"node_id {msg.node_id!r} differs from the sender {msg.sender!r}"
    if isinstance(msg, (TrainerRegister, TrainerInfo)):
        if msg.tensor_sizes is not None and sum(msg.tensor_sizes) <= 0:
            return "tensor_sizes describe an empty state"
    return ""
