"""The control plane's messages: every message once, as a typed, versioned msgspec schema.

Every message is a :class:`msgspec.Struct` of the tagged union :data:`Message` (tag field
``"type"``), encoded with msgpack. Each one carries the protocol version ``v``, the ``sender``'s
node id and the sender's membership ``epoch``; messages that belong to an election term also carry
``term``. Nothing is ever pickled.

All untrusted input goes through one function, :func:`chaos.protocol.codec.validate`, which turns
every bad frame into a :class:`Refusal` with a reason code from :class:`Reason` instead of raising.
The daemon answers a refusal (or drops and counts the frame) and keeps running.

Message kinds (the ``KIND`` class variable) decide which semantic checks apply:

* ``"peer"``: sent by a cluster member; refused with ``unknown_peer`` when the sender is not in
  the receiver's membership.
* ``"command"``: sent by the scheduler to members; refused with ``stale_term`` or
  ``stale_epoch`` when older than the receiver's term or epoch.
* ``"scheduler"``: the scheduler's heartbeat; refused with ``stale_term`` only (it is how members
  discover a newly elected scheduler).
* ``"open"``: joins, probes, replies and refusals; accepted from anyone.
* ``"client"``: the local CLI and the training process; not epoch-checked.

Messages with ``TO_SCHEDULER = True`` are refused with ``not_scheduler`` by a non-scheduler
(joins are forwarded instead), and with ``paused`` by a scheduler without a majority.

The trainer events (:class:`TrainerReady`, :class:`TrainerGone`, :class:`PullDone`,
:class:`StepFailed`, :class:`CaughtUp`, :class:`TrainerProgress`, :class:`NonfiniteStep`,
:class:`TrainerThroughput`, all :class:`TrainerEventBase`) have two kinds: sent by the trainer to
its local daemon they are ``"client"`` messages (``node_id`` unset); forwarded by that daemon to
the scheduler (with ``node_id`` set to the forwarding daemon's id) they are ``"peer"`` messages
with ``TO_SCHEDULER = True``. :func:`chaos.protocol.codec.kind_of` tells them apart.
"""

from __future__ import annotations

import enum
from typing import Annotated, ClassVar, Literal, Union

import msgspec

from chaos.protocol.ids import Address, Endpoint, NodeId
from chaos.protocol.states import NodeState, TrainerPhase, TrainerState
from chaos.scheduling.plan import PlanMethod
from chaos.wire import PROTOCOL_VERSION

DEFAULT_MAX_FRAME_BYTES = 1 << 20
"""Default cap on one encoded frame (1 MiB); bandwidth-probe chunks must fit below it."""

OpId = Annotated[str, msgspec.Meta(max_length=64)]
StateDigest = Annotated[str, msgspec.Meta(max_length=64, pattern=r"^[0-9a-f]*$")]
"""Hex SHA-256 of a restored training state (stop-resume); empty: not a restored state."""
Detail = Annotated[str, msgspec.Meta(max_length=1024)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
MAX_COUNTER = (1 << 53) - 1
"""Largest term, epoch or step a message may carry. Far beyond what a cluster reaches, it keeps
every counter exact as a float and far from any fixed-width integer limit: a forged
``2**64 - 1`` is refused as malformed instead of overflowing at the next increment."""
Counter = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNTER)]
"""A term, an epoch or a step: a bounded non-negative integer (see :data:`MAX_COUNTER`)."""
MAX_TERM_JUMP = 1 << 20
"""Most a member's message may carry a term ahead of the receiver's own. A term grows by one per
election, at most a few per second, so an honest member, even one partitioned for weeks, stays
far below this; a forged term near :data:`MAX_COUNTER` is refused instead of pushing every
daemon to the bound, where no election could ever be held again."""
MAX_EPOCH_JUMP = 1 << 20
"""Most a member's message may carry an epoch ahead of the receiver's own: an epoch grows by one
per commit, so an honest member is never this far ahead; a forged epoch near
:data:`MAX_COUNTER` is refused instead of taken up by the next commit."""
Seconds = Annotated[float, msgspec.Meta(ge=0.0)]
MAX_JOIN_CONTACTS = 16
"""Most member addresses a join refusal suggests to the joiner (:attr:`Refusal.members`)."""

MAX_STATE_TENSORS = 32_768
"""Most tensors a training state layout may list (keeps a ClusterUpdate well below 1 MiB)."""

TensorSizes = Annotated[list[NonNeg], msgspec.Meta(max_length=MAX_STATE_TENSORS)]
PublicKey = Annotated[str, msgspec.Meta(max_length=40, pattern=r"^[\x21-\x7e]*$")]
"""A CURVE public key, Z85 text (40 characters); empty: none (a cluster without a key)."""
SignKey = Annotated[str, msgspec.Meta(max_length=64, pattern=r"^[0-9a-f]*$")]
"""An Ed25519 public key, hex (64 characters); empty: none (a cluster without a key)."""
Signature = Annotated[str, msgspec.Meta(max_length=128, pattern=r"^[0-9a-f]*$")]
"""An Ed25519 signature, hex (128 characters); empty: none."""
MAX_CERT_VOTES = 256
"""Most votes a scheduler's certificate may list (no cluster is bigger than its view)."""
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
    JOINER_UNREACHABLE = "joiner_unreachable"
    """No member could open a connection to a joiner's advertised address (a device behind
    NAT or a firewall, or a ``--listen`` host the cluster cannot route to). The joiner asks
    again until its join timeout, whose error names it."""
    WOULD_DISCONNECT = "would_disconnect"
    BAD_REQUEST = "bad_request"
    TIMEOUT = "timeout"
    NO_STATE_SOURCE = "no_state_source"
    STATE_CONFLICT = "state_conflict"
    ID_IN_USE = "id_in_use"
    """A join names the id of a member still heard from under another key: retried until that
    incarnation is gone (a restarted device), refused for as long as it lives (an impostor)."""
    UNVERIFIED_SCHEDULER = "unverified_scheduler"
    """A scheduler's message from a sender that the receiver cannot verify won that term (no
    vote of its own, no valid certificate)."""
    NOT_AUTHENTICATED = "not_authenticated"
    """The sender is not the authenticated peer of the connection (another key than the one
    bound to its id at admission)."""
    FORBIDDEN = "forbidden"
    """The request is not allowed on this connection or by this daemon's configuration (e.g.
    ``leave`` over TCP without a cluster key, ``fault`` without ``--enable-fault-injection``)."""
    OVERLOADED = "overloaded"
    """A budget is exhausted (join rate, link measurements, sockets); retry later."""
    # a donor's shard server (chaos.replication.wire)
    NOT_PUBLISHED = "not_published"
    STALE_STATE = "stale_state"
    LAYOUT_MISMATCH = "layout_mismatch"
    MANIFEST_MISMATCH = "manifest_mismatch"
    OUT_OF_RANGE = "out_of_range"
    INTERNAL = "internal"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return self.value.__format__(spec)


ApplyAt = Literal["after_allreduce", "before_next_allreduce"]
FaultName = Literal["drop_to", "drop_from", "cut_link", "partition", "clear"]
MAX_OFFENDERS = 256
"""Most devices one :class:`NonfiniteStep` may name."""
MAX_ELAPSED_S = 1e9
"""Longest duration a trainer's progress report may state (about 31 years)."""
Elapsed = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_ELAPSED_S)]
"""A bounded, finite duration in seconds (a trainer's progress report)."""
MAX_BATCH = 1 << 31
"""Largest global or local batch (samples per step) a message may state."""
Rate = Annotated[float, msgspec.Meta(ge=0.0, le=1e12)]
"""A bounded, finite throughput in samples per second (0: not measured)."""
BatchSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_BATCH)]
"""Samples per step of one member, in a split of the global batch."""


class _Base(msgspec.Struct, kw_only=True, frozen=True, tag_field="type"):
    """Fields every message carries."""

    KIND: ClassVar[str] = "open"
    TO_SCHEDULER: ClassVar[bool] = False
    MUTATING: ClassVar[bool] = False
    TO_CLIENT: ClassVar[bool] = False
    """An answer only a client (the CLI, a trainer) takes: a daemon has no handler for it."""

    v: int = PROTOCOL_VERSION
    sender: Annotated[str, msgspec.Meta(max_length=64)] = ""
    epoch: Counter = 0


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
    state: NodeState
    joined_at: float
    neighbors: list[NodeId] = []
    resources: Resources | None = None
    data_address: Endpoint | None = None
    shard_address: Endpoint | None = None
    trainer: TrainerState = TrainerState.NONE
    public_key: PublicKey = ""
    """The daemon's CURVE public key, bound to its id at admission (empty: no cluster key)."""
    data_key: PublicKey = ""
    """Its trainer's CURVE public key (data plane and shard server; empty: none)."""
    sign_key: SignKey = ""
    """The daemon's Ed25519 vote-signing key, bound to its id at admission with ``public_key``
    (empty: no cluster key); see :mod:`chaos.daemon.vote_certs`."""


class Vote(msgspec.Struct, kw_only=True, frozen=True):
    """One signed vote of a scheduler's certificate."""

    voter: NodeId
    signature: Signature


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
    keys: dict[NodeId, PublicKey] = {}
    """The trainers' CURVE public keys (with a cluster key): a data frame is accepted only from
    the connection of the member it names."""
    batch_sizes: dict[NodeId, BatchSize] = {}
    """The global batch split across the members in proportion to their measured throughput
    (samples per step for each; they sum to the global batch): empty when no trainer asked
    for a global batch (``TrainerConfig.global_batch``). Not part of the data-plane structure."""
    topology_epoch: Counter = 0
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
    method: PlanMethod = PlanMethod.CHAOS
    per_shard_cost_s: Seconds = 0.0
    """The per-shard cost c the plan used (the monitor's measured value, or the configured
    prior before any pull was measured); a joiner's re-plans use it too."""
    at_step: Counter | None = None
    """A catch-up join's snapshot step: the donors serve a copy of their state at this step
    and train on, logging each later step for the joiner to replay. ``None``: the donors serve
    their live state at the step boundary where they install the policy (the joiner is in its
    data plane, so nobody steps until it has pulled)."""


MAX_PULL_RANGES = 4096
"""Most byte ranges one donor's entry of a :class:`PullReport` lists."""


def merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(offset, length)`` ranges in offset order, empty ones dropped and adjacent or
    overlapping ones merged: the form :class:`DonorPull` lists a donor's delivered bytes in."""
    out: list[tuple[int, int]] = []
    for off, n in sorted((int(o), int(k)) for o, k in ranges if k > 0):
        if out and out[-1][0] + out[-1][1] >= off:
            last = out[-1]
            out[-1] = (last[0], max(last[0] + last[1], off + n) - last[0])
        else:
            out.append((off, n))
    return out


class DonorPull(msgspec.Struct, kw_only=True, frozen=True):
    """What one donor sent in a joiner's pull (part of a :class:`PullReport`).

    ``elapsed_s`` runs from the request that brought its first shard to its last shard;
    ``ranges`` are the byte ranges it delivered, adjacent ones merged; ``failed`` is why the
    joiner dropped it (empty: it finished its part).
    """

    id: NodeId
    bytes: NonNeg = 0
    shards: NonNeg = 0
    elapsed_s: Annotated[float, msgspec.Meta(ge=0.0, le=1e9)] = 0.0
    ranges: Annotated[list[tuple[NonNeg, NonNeg]], msgspec.Meta(max_length=MAX_PULL_RANGES)] = []
    failed: Annotated[str, msgspec.Meta(max_length=64)] = ""


class PullReport(msgspec.Struct, kw_only=True, frozen=True):
    """A joiner's account of the pull it executed (:attr:`PullDone.pull`).

    ``reason`` says why the plan it started with differs from the scheduler's (empty: it is
    the scheduler's); ``per_shard_cost_s`` is the c its re-plans used; ``replans`` counts the
    re-plans after a donor failed.
    """

    reason: Annotated[str, msgspec.Meta(max_length=256)] = ""
    per_shard_cost_s: Seconds = 0.0
    replans: NonNeg = 0
    state_bytes: NonNeg = 0
    donors: Annotated[list[DonorPull], msgspec.Meta(max_length=256)] = []


MAX_PULL_DONORS = 256


class PullStatus(msgspec.Struct, kw_only=True, frozen=True):
    """A joiner's pull as it goes (:attr:`TrainerProgress.pulling`): the bytes
    verified so far of the bytes it pulls, and per donor."""

    pulled_bytes: Counter = 0
    total_bytes: Counter = 0
    donors: Annotated[dict[NodeId, Counter], msgspec.Meta(max_length=MAX_PULL_DONORS)] = {}


MAX_ACTIVITY = 4096
MAX_STATUS_EVENTS = 200
EventName = Annotated[str, msgspec.Meta(max_length=64)]
EventText = Annotated[str, msgspec.Meta(max_length=256)]


class MemberActivity(msgspec.Struct, kw_only=True, frozen=True):
    """A training member as the scheduler hears it (``StatusReply.activity``): its step now
    (extrapolated from its last step boundary and period), its steps per second (0: not
    measured yet) and how long ago it was heard."""

    id: NodeId
    step: Counter = 0
    steps_per_s: Rate = 0.0
    heard_s: Elapsed = 0.0
    phase: TrainerPhase | None = None
    """Its trainer's phase, as its last progress report said (``None``: not said yet)."""


class JoinActivity(msgspec.Struct, kw_only=True, frozen=True):
    """A join in progress as the scheduler hears it (``StatusReply.joins``): the joiner's
    trainer pulls the state; ``pull`` is its last progress report (``None``: none yet)."""

    id: NodeId
    donors: Annotated[list[NodeId], msgspec.Meta(max_length=MAX_PULL_DONORS)] = []
    pull: PullStatus | None = None
    heard_s: Elapsed = 0.0
    phase: TrainerPhase | None = None
    """The joiner's trainer's phase (pulling, catching up, entering), as it last said."""


class EventEntry(msgspec.Struct, kw_only=True, frozen=True):
    """One event of a daemon's recent history (``StatusReply.events``): its time (Unix
    seconds), node, name, the peer it is about, a short text of its other fields and, when it
    says one, the duration it measured (``delay_s``, ``elapsed_s``)."""

    ts: Annotated[float, msgspec.Meta(ge=0.0, le=1e11)]
    node: NodeId
    event: EventName
    peer: NodeId | None = None
    text: EventText = ""
    seconds: Elapsed | None = None


class ClusterView(msgspec.Struct, kw_only=True, frozen=True):
    """The scheduler's cluster view at one epoch."""

    epoch: Counter
    term: Counter
    scheduler: NodeId | None
    nodes: list[NodeInfo]
    links: list[LinkInfo]


# ----------------------------------------------------------------------------- peer messages


class SchedulerHeartbeat(_Base, frozen=True, tag="scheduler_heartbeat"):
    """Scheduler -> every member, every heartbeat interval."""

    KIND: ClassVar[str] = "scheduler"
    term: Counter
    cert: Annotated[list[Vote], msgspec.Meta(max_length=MAX_CERT_VOTES)] = []
    """The signed votes the sender won ``term`` with (empty without a cluster key)."""


class MemberHeartbeat(_Base, frozen=True, tag="member_heartbeat"):
    """Member -> scheduler, every heartbeat interval, with local resources."""

    KIND: ClassVar[str] = "peer"
    TO_SCHEDULER: ClassVar[bool] = True
    term: Counter
    resources: Resources | None = None


class RequestVote(_Base, frozen=True, tag="request_vote"):
    """Candidate -> members (Raft). ``epoch`` is the candidate's view epoch."""

    KIND: ClassVar[str] = "peer"
    term: Counter
    transfer: bool = False


class VoteReply(_Base, frozen=True, tag="vote_reply"):
    """Member -> candidate."""

    KIND: ClassVar[str] = "peer"
    term: Counter
    granted: bool
    signature: Signature = ""
    """A granted vote, signed by the voter's bound signing key (empty without a cluster key)."""


class TimeoutNow(_Base, frozen=True, tag="timeout_now"):
    """Leaving scheduler -> chosen successor: start an election now (scheduler handover)."""

    KIND: ClassVar[str] = "command"
    term: Counter


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
    public_key: PublicKey = ""
    """The joiner's CURVE public key; the member it contacts checks it is the key of the
    connection it came in on, and the scheduler binds it to ``node_id`` at admission."""
    sign_key: SignKey = ""
    """The joiner's vote-signing key, bound to ``node_id`` at admission with ``public_key``."""
    incarnation: OpId = ""
    """A nonce drawn once per daemon process: the scheduler tells a retry of a join it admitted
    (same nonce: the admission is sent again) from a restart at the same address (a new one:
    the old incarnation is replaced), with or without a cluster key."""


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
    term: Counter
    peer: NodeId
    address: Address
    measure_bandwidth: bool = True
    op_id: OpId = ""


class LinkReport(_Base, frozen=True, tag="link_report"):
    """Member -> scheduler: the measured link from ``sender`` to ``peer``."""

    KIND: ClassVar[str] = "peer"
    TO_SCHEDULER: ClassVar[bool] = True
    term: Counter
    peer: NodeId
    up: bool
    latency_s: Seconds | None = None
    bandwidth_bps: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    op_id: OpId = ""


class AgentReport(_Base, frozen=True, tag="agent_report"):
    """Member -> new scheduler after an election: what this agent knows about itself."""

    KIND: ClassVar[str] = "peer"
    TO_SCHEDULER: ClassVar[bool] = True
    term: Counter
    address: Address
    joined_at: float
    links: Annotated[list[LinkInfo], msgspec.Meta(max_length=256)] = []
    resources: Resources | None = None
    data_address: Endpoint | None = None
    shard_address: Endpoint | None = None
    trainer: TrainerState = TrainerState.NONE
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
    data_key: PublicKey = ""
    """The trainer's CURVE public key (from its registration; empty: no cluster key)."""
    catch_up: bool = False
    """The joiner catches up (see :class:`TrainerRegister`)."""


class ClusterUpdate(_Base, frozen=True, tag="cluster_update"):
    """Scheduler -> every member: the new view and policies, applied at a step boundary."""

    KIND: ClassVar[str] = "command"
    term: Counter
    view: ClusterView
    sync: SyncPolicyWire
    replication: ReplicationWire | None = None
    apply_at: ApplyAt = "after_allreduce"
    restart_allreduce: bool = False
    cause: Annotated[str, msgspec.Meta(max_length=64)] = ""
    op_id: OpId = ""
    cert: Annotated[list[Vote], msgspec.Meta(max_length=MAX_CERT_VOTES)] = []
    """The signed votes the sender won ``term`` with (empty without a cluster key)."""


class PolicyAck(_Base, frozen=True, tag="policy_ack"):
    """Member -> scheduler: the policy of ``epoch`` is installed."""

    KIND: ClassVar[str] = "peer"
    TO_SCHEDULER: ClassVar[bool] = True
    term: Counter


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
    """A refused message or request: ``reason`` says why, ``detail`` in words.

    The one refusal of every msgpack channel: the control plane (where ``term`` and
    ``scheduler`` help the sender find the scheduler) and a donor's shard server (where
    ``req_id`` names the refused request and ``v`` is the replication wire's version, see
    :func:`chaos.replication.wire.refusal`).

    ``members`` (protocol version 4) lists other members' control addresses that a contact
    which cannot admit a joiner (``not_scheduler``, ``paused``) knows, so that the joiner tries
    them next; only a refusal of a ``join_request`` may carry it
    (:func:`chaos.protocol.codec.validate`), with at most :data:`MAX_JOIN_CONTACTS` distinct
    addresses.

    ``joiner`` (protocol version 12) names the joiner a refusal of a *forwarded* join is for:
    the scheduler sends it to the member that forwarded the join, which hands it on over the
    connection the joiner opened to it (a joiner behind NAT cannot be dialled at its own
    address). Only a refusal of a ``join_request`` may carry it.
    """

    reason: Reason
    detail: Detail = ""
    ref_type: Annotated[str, msgspec.Meta(max_length=64)] = ""
    term: Counter = 0
    scheduler: NodeId | None = None
    req_id: NonNeg = 0
    members: Annotated[list[Address], msgspec.Meta(max_length=MAX_JOIN_CONTACTS)] = []
    joiner: NodeId | None = None


# ----------------------------------------------------------------------------- client messages


class StatusRequest(_Base, frozen=True, tag="status_request"):
    """CLI -> daemon."""

    KIND: ClassVar[str] = "client"


class DoctorRequest(_Base, frozen=True, tag="doctor_request"):
    """CLI -> daemon: ``chaos-daemon doctor``, the daemon's checks of its own setup."""

    KIND: ClassVar[str] = "client"


class DoctorCheck(msgspec.Struct, kw_only=True, frozen=True):
    """One check of ``doctor``: what was checked, how it stands, and what to do."""

    name: Annotated[str, msgspec.Meta(max_length=32)]
    status: Literal["ok", "warn", "fail"]
    detail: Detail
    fix: Detail = ""
    """What to do about a ``warn`` or a ``fail`` (empty for ``ok``)."""


class DoctorReply(_Base, frozen=True, tag="doctor_reply"):
    """Daemon -> CLI: the checks of :class:`DoctorRequest`, worst first."""

    TO_CLIENT: ClassVar[bool] = True

    checks: Annotated[list[DoctorCheck], msgspec.Meta(max_length=32)]


_Note = Annotated[str, msgspec.Meta(max_length=256)]


class StatusReply(_Base, frozen=True, tag="status_reply"):
    """Daemon -> CLI: the local node's state and its copy of the cluster view."""

    TO_CLIENT: ClassVar[bool] = True

    node_id: NodeId
    role: Literal["follower", "candidate", "scheduler"]
    state: Annotated[str, msgspec.Meta(max_length=32)]
    paused: bool
    scheduler: NodeId | None
    term: Counter
    nodes: list[NodeInfo]
    links: list[LinkInfo]
    sync: SyncPolicyWire | None = None
    notes: Annotated[list[_Note], msgspec.Meta(max_length=32)] = []
    audit: AuditInfo | None = None
    """This node's trainer's state audit, as its last progress report said (``None``: none
    reported)."""
    activity: Annotated[list[MemberActivity], msgspec.Meta(max_length=MAX_ACTIVITY)] = []
    """The scheduler only: every training member's step and rate."""
    joins: Annotated[list[JoinActivity], msgspec.Meta(max_length=MAX_ACTIVITY)] = []
    """The scheduler only: the joins in progress, with their pulls."""
    events: Annotated[list[EventEntry], msgspec.Meta(max_length=MAX_STATUS_EVENTS)] = []
    """This daemon's most recent events, oldest first."""
    trainer_phase: TrainerPhase | None = None
    """This node's trainer's phase, as its last progress report said (``None``: no trainer
    has reported one)."""


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

    TO_CLIENT: ClassVar[bool] = True

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
    ``pid``: the trainer's process id, which the local daemon watches (``None``: unwatched).
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
    pid: Annotated[int, msgspec.Meta(ge=1)] | None = None
    public_key: PublicKey = ""
    """The trainer's CURVE public key, the client key of its data-plane connections (empty:
    no cluster key)."""
    catch_up: bool = False
    """A joiner (``has_state`` false) that joins by catching up: it pulls a snapshot while the
    members train on, replays the steps it missed, and enters the allreduce afterwards
    (``TrainerConfig.join_mode``)."""


class AuditInfo(msgspec.Struct, kw_only=True, frozen=True):
    """A trainer's state audit (``TrainerConfig.audit_every``): the last audited ``step`` and
    whether every member agreed there; ``audits`` run, ``mismatches`` (audits that found any
    member different) and ``healed`` (times this trainer pulled the state again)."""

    step: Counter = 0
    agreed: bool = True
    audits: Counter = 0
    mismatches: Counter = 0
    healed: Counter = 0


class TrainerEventBase(_Base, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """What every trainer event shares (each is its own tagged message, below).

    Trainer -> local daemon (``node_id`` unset: a ``"client"`` message) -> scheduler
    (``node_id`` = ``sender``: a ``"peer"`` message to the scheduler;
    :func:`chaos.protocol.codec.kind_of` tells them apart). A field another event owns is
    refused as ``malformed`` (``forbid_unknown_fields``). ``NAME`` is what the daemons' event
    logs call the event (``trainer_event``'s ``kind``).
    """

    KIND: ClassVar[str] = "client"
    NAME: ClassVar[str] = ""
    node_id: NodeId | None = None


class AnsweredEventBase(TrainerEventBase, kw_only=True, frozen=True):
    """A trainer event the scheduler answers with an :class:`OpResult` under ``op_id``."""

    op_id: OpId = ""


class TrainerReady(AnsweredEventBase, frozen=True, tag="trainer_ready"):
    """The trainer holds the state and takes part in training (a syncing trainer becomes
    ``training``). ``elapsed_s``: its own time for the join; ``step``: the step it enters at
    (its daemon starts the trainer's silence clock there)."""

    NAME: ClassVar[str] = "ready"
    elapsed_s: Seconds = 0.0
    detail: Detail = ""
    step: Counter = 0


class TrainerGone(AnsweredEventBase, frozen=True, tag="trainer_gone"):
    """Sent by the local daemon only: its trainer's process exited (``detail`` says which);
    the node stays a member without a trainer."""

    NAME: ClassVar[str] = "gone"
    detail: Detail = ""


class PullDone(AnsweredEventBase, frozen=True, tag="pull_done"):
    """A joiner's pull of the state ended: ``pull`` is what it executed (the scheduler measures
    the per-shard cost from it and logs ``replication_executed``)."""

    NAME: ClassVar[str] = "replication_done"
    pull: PullReport


class StepFailed(AnsweredEventBase, frozen=True, tag="step_failed"):
    """The trainer's allreduce of ``epoch`` (the epoch the step ran under, kept when forwarded)
    failed after ``elapsed_s``, blaming ``detail`` (the neighbour that stopped); the answer's
    ``detail`` names the member the scheduler blames."""

    NAME: ClassVar[str] = "step_failed"
    elapsed_s: Seconds = 0.0
    detail: Detail = ""


class CaughtUp(AnsweredEventBase, frozen=True, tag="caught_up"):
    """A catching-up joiner asks to enter the data plane (``detail``: how far it replayed)."""

    NAME: ClassVar[str] = "caught_up"
    detail: Detail = ""


class TrainerProgress(TrainerEventBase, frozen=True, tag="trainer_progress"):
    """The step heartbeat that finds a straggler (docs/daemon.md); one-way, never answered.

    From the trainer it says the trainer is alive at ``step``, inside ``update()``
    (``in_step``) or computing, for ``elapsed_s`` in that phase; the daemon forwards the latest
    one to the scheduler every heartbeat interval, with ``silent_s``, the time since its trainer
    was last heard, and ``elapsed_s`` aged to that moment. A trainer with a global batch adds
    ``samples_per_s`` (samples per second of compute, allreduce waits excluded) and
    ``global_batch``, which its daemon forwards as :class:`TrainerThroughput`.
    """

    NAME: ClassVar[str] = "progress"
    step: Counter = 0
    in_step: bool = False
    elapsed_s: Seconds = 0.0
    silent_s: Elapsed = 0.0
    samples_per_s: Rate = 0.0
    global_batch: Annotated[int, msgspec.Meta(ge=0, le=MAX_BATCH)] = 0
    audit: AuditInfo | None = None
    """The trainer's state audit, once it ran one (its daemon keeps the latest for
    ``status``)."""
    pulling: PullStatus | None = None
    """From a joiner pulling the state: how far the pull is (the scheduler shows it in
    ``status``; such a report says nothing of steps)."""
    phase: TrainerPhase | None = None
    """Where the trainer is in its lifecycle (:mod:`chaos.trainer.lifecycle`; its daemon's
    ``status`` shows it, and the scheduler's for every member)."""


class NonfiniteStep(TrainerEventBase, frozen=True, tag="nonfinite_step"):
    """The trainer skipped ``step`` because its summed gradients were not finite, naming in
    ``devices`` the members whose contribution was marked bad; one-way, never answered. Its
    daemon forwards it to the scheduler at once, which evicts a device that a majority of the
    training members named in enough steps (:mod:`chaos.daemon.scheduler.offenders`)."""

    NAME: ClassVar[str] = "nonfinite"
    step: Counter = 0
    devices: Annotated[list[NodeId], msgspec.Meta(max_length=MAX_OFFENDERS)] = []


class TrainerThroughput(TrainerEventBase, frozen=True, tag="trainer_throughput"):
    """Sent by a daemon only, one-way: its trainer's throughput (``samples_per_s``) and
    ``global_batch``, from the trainer's progress, when they change; the scheduler splits the
    global batch by them (``SyncPolicyWire.batch_sizes``)."""

    NAME: ClassVar[str] = "throughput"
    samples_per_s: Rate = 0.0
    global_batch: Annotated[int, msgspec.Meta(ge=0, le=MAX_BATCH)] = 0


AnsweredEvent = Union[TrainerReady, TrainerGone, PullDone, StepFailed, CaughtUp]
"""The trainer events the scheduler answers (:class:`AnsweredEventBase`)."""
AnyTrainerEvent = Union[AnsweredEvent, TrainerProgress, NonfiniteStep, TrainerThroughput]
"""Every trainer event (:class:`TrainerEventBase`), one message type each."""


class PolicyReply(_Base, frozen=True, tag="policy_reply"):
    """Daemon -> trainer (``epoch`` is the policy's epoch)."""

    TO_CLIENT: ClassVar[bool] = True

    term: Counter
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

    TO_CLIENT: ClassVar[bool] = True

    KIND: ClassVar[str] = "client"
    paused: bool = False
    interval_s: Seconds = 0.0
    policy: PolicyReply | None = None
    """The policy of ``epoch``, carried by the notice of a change when it is small (a trainer
    then installs it without asking); ``None`` in the periodic notices."""


Message = Union[
    SchedulerHeartbeat,
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
    DoctorRequest,
    DoctorReply,
    LeaveCommand,
    LinkCommand,
    FaultCommand,
    FaultReply,
    PolicyRequest,
    PolicyReply,
    PolicyNotice,
    TrainerRegister,
    TrainerInfo,
    TrainerReady,
    TrainerGone,
    PullDone,
    StepFailed,
    CaughtUp,
    TrainerProgress,
    NonfiniteStep,
    TrainerThroughput,
]
