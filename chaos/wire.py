"""Every versioned wire and file format of Chaos, in one place.

Each format's version constant, its fixed binary layouts and its byte order are defined here and
imported by the module that speaks it; :data:`FORMATS` lists them all. Bump a version on every
incompatible change of its format. Rules that hold for all of them:

* **Byte order.** Every fixed binary header is little-endian (:data:`BYTE_ORDER`). msgpack
  defines its own encoding (big-endian numbers), which msgspec writes and reads; the payloads
  after a header are raw tensor bytes in the host's order, which every supported device
  (x86-64, ARM64) shares with the headers.
* **No pickle.** Structured messages are msgspec schemas encoded as msgpack; bulk data is raw
  bytes behind a fixed header.
* **One check per format.** Untrusted input is validated in one function per format, named in
  :data:`FORMATS`, which refuses with a reason code (msgpack channels) or raises
  :class:`~chaos.errors.ProtocolError` (fixed headers) and never crashes the receiver.

This module imports neither torch nor ZeroMQ, so every process can read it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

BYTE_ORDER = "<"
"""The :mod:`struct` byte-order prefix of every fixed binary header (little-endian)."""

# ----------------------------------------------------------------------------- control plane

PROTOCOL_VERSION = 12
"""The control plane's messages (:mod:`chaos.protocol.messages`), daemon to daemon, CLI and
trainer to daemon. 3: one :class:`~chaos.protocol.messages.Refusal` for every msgpack channel
(``req_id``, the shard server's reason codes). 4: a join's refusal may list other members'
addresses for the joiner to try (``Refusal.members``). 5: catch-up joins (a registration's
``catch_up``, a replication plan's snapshot step ``at_step``, the trainer event
``caught_up``). 6: the trainer event ``nonfinite`` (a skipped step's offending ``devices``),
which the scheduler evicts repeat offenders by. 7: signed votes and the scheduler's certificate
(``VoteReply.signature``, ``SchedulerHeartbeat.cert``, ``ClusterUpdate.cert``,
``NodeInfo.sign_key``, ``JoinRequest.sign_key``); the reasons ``id_in_use`` and
``unverified_scheduler``. 8: a join's incarnation nonce (``JoinRequest.incarnation``). 9: what
a live view of the cluster shows (``StatusReply.activity``, ``joins`` and ``events``; a joiner's
pull progress, the trainer event's ``pulling``). 10: the trainer's lifecycle phase (the
trainer event's ``phase``, ``StatusReply.trainer_phase``, ``MemberActivity.phase``,
``JoinActivity.phase``). 11: one message type per trainer event instead of one
``trainer_event`` with a ``kind`` (``TrainerReady``, ``TrainerGone``, ``PullDone``,
``StepFailed``, ``CaughtUp``, ``TrainerProgress``, ``NonfiniteStep``, ``TrainerThroughput``),
each with only its own fields; a field another event owns is refused. 12: the refusal of a
join whose joiner no member could dial (reason ``joiner_unreachable``), and a forwarded join's
refusal that the forwarding member hands on to the joiner (``Refusal.joiner``). A new request
only a
client sends needs no new version (``doctor_request``): an older daemon refuses its unknown type
as ``malformed``."""

# ----------------------------------------------------------------------------- replication

REPLICATION_VERSION = 3
"""A donor's shard server and a joiner (:mod:`chaos.replication.wire`). 2: refusals are the
control plane's :class:`~chaos.protocol.messages.Refusal`. 3: the step log of a catch-up join
(``StepLogRequest``, ``StepLogReply``: the averaged gradients and hyperparameters of the steps
a joiner replays)."""

STATE_FORMAT_VERSION = 3
"""The canonical training-state stream and its manifest (:mod:`chaos.replication.state`). 2: the
extra state objects (LR schedulers, a ``GradScaler``, an EMA model): their tensors between the
optimizer's and the runtime record, their encoded ``state_dict()`` in the manifest. 3: the
manifest carries a content address (SHA-256, 128 bits) per chunk of the stream, so a joiner
pulls only the chunks it does not hold."""

# ----------------------------------------------------------------------------- data plane

FRAME_VERSION = 3
"""The allreduce frame header (:mod:`chaos.collectives.frames`). 3: the dtype code 5, the
blockwise int8 format (:mod:`chaos.collectives.compress`), whose ``nelem`` counts payload
bytes."""

FRAME_HEADER = struct.Struct(BYTE_ORDER + "BBBBIQQII")
"""version u8, op u8, dtype u8, reserved u8, seg u32, epoch u64, step u64, chunk u32,
nelem u32: 32 bytes, then the raw chunk."""

LANE_VERSION = 2
"""A payload lane's hello and offer (:mod:`chaos.collectives.lanes`). 2: with a cluster key the
offer carries a lane key and every byte on the lane is sealed with AES-256-GCM (the sealed
layouts below)."""

LANE_MAGIC = b"CHLN"
"""The first four bytes of a lane hello."""

LANE_HELLO = struct.Struct(BYTE_ORDER + "4sBQB")
"""magic 4s, version u8, token u64, id length u8; then the node id (utf-8)."""

LANE_OFFER = struct.Struct(BYTE_ORDER + "HQ")
"""port u16, token u64: the payload of an ``Op.LANE`` frame."""

LANE_SEALED_MAGIC = b"CHLS"
"""The first four bytes of a sealed lane hello (a communicator with a cluster key)."""

LANE_SEALED_OFFER = struct.Struct(BYTE_ORDER + "HQ32s")
"""port u16, token u64, lane key 32s: the payload of an ``Op.LANE`` frame with a cluster key
(it travels inside the CURVE-encrypted link)."""

LANE_SEALED_HELLO = struct.Struct(BYTE_ORDER + "4sBIH")
"""magic 4s, version u8, attempt u32, sealed length u16; then the sealed body (the hello's
associated data is these 11 bytes)."""

LANE_HELLO_BODY = struct.Struct(BYTE_ORDER + "QB")
"""token u64, id length u8; then the node id (utf-8): the plaintext of a sealed hello."""

LANE_NONCE = struct.Struct(BYTE_ORDER + "IQ")
"""The AES-GCM nonce of a sealed lane record: direction << 24 | attempt u32, counter u64."""

LANE_RECORD_BYTES = 1 << 20
"""A sealed lane's frame payload is sealed as records of this many plaintext bytes (the last
one shorter), each followed by its 16-byte tag, so that a large chunk's records are opened
while the next one is read."""

# ----------------------------------------------------------------------------- emulation

CHECKPOINT_VERSION = 2
"""The stop-resume baseline's checkpoint store (:mod:`chaos.emulate.ckpt_store`). 2: the header
is little-endian like every other."""

CHECKPOINT_MAGIC = b"CKPT"
"""The first four bytes of a checkpoint store's header."""

CHECKPOINT_HEADER = struct.Struct(BYTE_ORDER + "4sHQ32s")
"""magic 4s, version u16, payload size u64, payload SHA-256 32s; then the payload."""


@dataclass(frozen=True)
class WireFormat:
    """One versioned format.

    Args:
        name: What it carries.
        version: Its version constant.
        encoding: ``msgpack`` (msgspec schemas) or ``struct`` (a fixed header, then raw bytes).
        module: The module that speaks it.
        check: The one function that validates untrusted input of this format.
        layouts: Its fixed binary layouts (empty for msgpack formats).
    """

    name: str
    version: int
    encoding: str
    module: str
    check: str
    layouts: tuple[struct.Struct, ...] = ()


FORMATS: tuple[WireFormat, ...] = (
    WireFormat(
        "control-plane messages",
        PROTOCOL_VERSION,
        "msgpack",
        "chaos.protocol",
        "chaos.protocol.codec.validate",
    ),
    WireFormat(
        "shard requests and replies",
        REPLICATION_VERSION,
        "msgpack",
        "chaos.replication.wire",
        "chaos.replication.wire.validate_request",
    ),
    WireFormat(
        "training-state stream and manifest",
        STATE_FORMAT_VERSION,
        "msgpack",
        "chaos.replication.state",
        "chaos.replication.state.decode_manifest",
    ),
    WireFormat(
        "allreduce frames",
        FRAME_VERSION,
        "struct",
        "chaos.collectives.frames",
        "chaos.collectives.frames.decode_header",
        (FRAME_HEADER,),
    ),
    WireFormat(
        "payload-lane hello and offer",
        LANE_VERSION,
        "struct",
        "chaos.collectives.lanes",
        "chaos.collectives.lanes.Lanes._greet",
        (LANE_HELLO, LANE_OFFER, LANE_SEALED_OFFER, LANE_SEALED_HELLO, LANE_HELLO_BODY,
         LANE_NONCE),
    ),
    WireFormat(
        "checkpoint store",
        CHECKPOINT_VERSION,
        "struct",
        "chaos.emulate.ckpt_store",
        "chaos.emulate.ckpt_store.fetch",
        (CHECKPOINT_HEADER,),
    ),
)
"""Every versioned format, for docs and for the test that keeps this list true."""
