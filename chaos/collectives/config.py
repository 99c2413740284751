"""Settings and counters of a :class:`~chaos.collectives.communicator.Communicator`.

Both are re-exported by :mod:`chaos.collectives.communicator` and :mod:`chaos.collectives`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = [
    "DEFAULT_MAX_EARLY_BYTES", "WIRE_NAMES", "CollectiveStats", "CommunicatorConfig", "ReduceOp",
]  # fmt: skip

ReduceOp = Literal["sum", "mean"]

WIRE_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
              "float64": torch.float64, "int8": torch.int8}  # fmt: skip
"""Wire dtype names accepted by ``wire_dtype``, and the dtype each one sends (``int8``: the
blockwise format of :mod:`chaos.collectives.compress`, float32 inputs and halves only)."""

DEFAULT_MAX_EARLY_BYTES = 256 << 20
"""Default of :attr:`CommunicatorConfig.max_early_bytes` (a trainer's floor, see
:attr:`TrainerConfig.max_early_bytes <chaos.trainer.config.TrainerConfig.max_early_bytes>`)."""


@dataclass(frozen=True)
class CommunicatorConfig:
    """Settings of one node's :class:`~chaos.collectives.communicator.Communicator`.

    Args:
        node_id: This node's id, as it appears in topologies.
        listen: The data endpoint to bind (``tcp://HOST:PORT``; port ``*`` picks a free one, see
            :attr:`Communicator.address`).
        chunk_bytes: Wire bytes per frame, at most. Smaller chunks pipeline deeper (tree stages
            overlap more, ring reduce and send overlap) but cost a fixed per-frame overhead; tune
            it up on fast links, down on slow deep trees.
        min_chunks: A tree round of more than two members cuts its tensor into at least this
            many chunks, so that a tensor of a few chunk sizes still pipelines (the reduce and
            the broadcast overlap, and on a slow link the levels fill and drain in a fraction
            of the transfer), unless chunks would get smaller than ``min_chunk_bytes``. 1:
            always ``chunk_bytes``. (A ring, and a tree of two, which runs as a ring of two,
            keep every link busy at any chunk size.)
        min_chunk_bytes: The smallest chunk ``min_chunks`` cuts to (``chunk_bytes`` if lower).
        timeout_s: Default progress timeout of a collective: the longest wait for the next frame
            (or for the last sends to leave) before the neighbour is declared failed.
        wire_dtype: Default wire format: ``None`` sends in the accumulation dtype (float32 for
            half inputs); ``"float16"``/``"bfloat16"`` halve the bytes, accumulating in float32;
            ``"int8"`` sends about a quarter of float32's (blockwise int8 with a float32 scale
            per 256 values, :mod:`chaos.collectives.compress`), accumulating in float32, with
            error feedback when the call passes an
            :class:`~chaos.collectives.compress.ErrorFeedback`.
        sndhwm: Per-link send queue limit in frames (0: unlimited).
        sock_buf_bytes: Kernel socket buffer size (SO_SNDBUF/SO_RCVBUF) of every link; 0 keeps
            the OS default. Raise it on links with a large bandwidth-delay product.
        io_threads: ZeroMQ I/O threads of the context; more help only with many fast links.
        max_early_frames: Frames of a future (epoch, step) kept until their allreduce starts
            (and, apart, frames of a later epoch waiting for its topology to name their
            sender's key); beyond this they are dropped and counted.
        max_early_bytes: Most bytes those frames hold in all (both kinds together); beyond
            it they are dropped and counted (``dropped_early_bytes``). It bounds the memory
            anyone with the cluster key can pin with frames of a later round. Honest frames
            come at most a round or two early; raise it for large tensors sent without lanes.
        max_early_epochs: A frame whose epoch is more than this many epochs ahead of the
            installed topology's is dropped and counted (``dropped_early_far``): an honest
            member is one or two epochs ahead (it rebuilt first). Before the first topology
            only the bytes and count bounds apply.
        poll_slice_s: Longest single poll, so that a peer reported dead from another thread
            (:meth:`Communicator.report_dead`) is noticed within this time.
        quiet_probe_s: A round that has heard nothing from the neighbour it waits for in this
            long asks that neighbour whether it completed the step already (a ``BEHIND``
            notice), and again every as long; a neighbour a step ahead answers with the step's
            kept result. It recovers a member that missed a result frame (a lossy link, a cut
            healed in the middle of a broadcast) long before ``timeout_s``. Lower it for faster
            recovery; it costs one small notice per interval while a round waits.
        keep_frame_memory: Make glibc keep freed frame buffers mapped for reuse (see
            :mod:`chaos.allocator`; process-wide). Saves the kernel zeroing fresh
            pages for every received frame; turn it off if the process must give memory back
            to the OS eagerly.
        lanes: Carry tensor chunks over one plain TCP connection per link direction (read
            straight into the result, written straight from the tensor) instead of through
            ZeroMQ; ZeroMQ still carries every notice and detects failures (see
            :mod:`chaos.collectives.lanes`). Only for ``tcp://`` endpoints. Turn it off where
            only the ZeroMQ port may be opened between devices.
        lane_min_bytes: Smallest tensor (in wire bytes) sent over the lanes; a link's lanes
            are set up at its first round of such a tensor. Below it, ZeroMQ's copy costs less
            than a lane's set-up and per-frame polling (on loopback: lanes slower at 256 KiB,
            even at 1 MiB, ahead from 4 MiB). Lower it for links where copies dominate.

    Raises:
        ValueError: an empty node id, a non-positive size or timeout, or an unknown wire dtype.
    """

    node_id: str
    listen: str = "tcp://127.0.0.1:*"
    chunk_bytes: int = 1 << 20
    min_chunks: int = 32
    min_chunk_bytes: int = 64 << 10
    timeout_s: float = 30.0
    wire_dtype: str | None = None
    sndhwm: int = 0
    sock_buf_bytes: int = 0
    io_threads: int = 1
    max_early_frames: int = 4096
    max_early_bytes: int = DEFAULT_MAX_EARLY_BYTES
    max_early_epochs: int = 64
    poll_slice_s: float = 0.1
    quiet_probe_s: float = 2.0
    keep_frame_memory: bool = True
    lanes: bool = True
    lane_min_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        if not self.node_id:
            raise ValueError("node_id must not be empty")
        if not self.listen.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"listen must be a ZeroMQ endpoint, not {self.listen!r}")
        if self.chunk_bytes < 64:
            raise ValueError("chunk_bytes must be >= 64")
        if self.min_chunks < 1 or self.min_chunk_bytes < 64:
            raise ValueError("min_chunks must be >= 1 and min_chunk_bytes >= 64")
        for name in ("timeout_s", "poll_slice_s", "quiet_probe_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if self.wire_dtype is not None and self.wire_dtype not in WIRE_NAMES:
            raise ValueError(f"wire_dtype must be one of {sorted(WIRE_NAMES)} or None")
        for name in ("sndhwm", "sock_buf_bytes", "max_early_frames", "lane_min_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.io_threads < 1:
            raise ValueError("io_threads must be >= 1")
        for name, low in (("max_early_bytes", 0), ("max_early_epochs", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


@dataclass
class CollectiveStats:
    """Counters of one communicator (monotonic, for metrics and tests)."""

    allreduces: int = 0
    failures: int = 0
    frames_received: int = 0
    dropped_stale: int = 0
    """Frames of an older (epoch, step) than the running or last allreduce: dropped unread."""
    dropped_malformed: int = 0
    dropped_unknown_peer: int = 0
    dropped_early_overflow: int = 0
    """Frames of a later round dropped because ``max_early_frames`` were kept already."""
    dropped_early_bytes: int = 0
    """Frames of a later round dropped because the frames kept for later rounds would take
    more than ``max_early_bytes``."""
    dropped_early_far: int = 0
    """Frames dropped because their epoch is more than ``max_early_epochs`` ahead of the
    installed topology's (the first few of these three kinds are logged)."""
    early_buffered: int = 0
    results_sent: int = 0
    """Kept round results sent to a neighbour that was a step behind (:attr:`Op.RESULT`),
    including those passed on after this node caught up itself."""
    quiet_probes: int = 0
    """BEHIND notices sent because the neighbour a round waited for stayed quiet."""
    frames_lost_by_fault: int = 0
    """Data frames not sent because of :meth:`Communicator.lose_frames_to` (fault injection)."""
    caught_up: int = 0
    """Rounds this node completed with a neighbour's kept result instead of running them."""
    lane_frames_sent: int = 0
    """Data frames queued on a payload lane rather than sent through ZeroMQ."""
    data_bytes_sent: int = 0
    """Bytes of the data frames sent (headers and payloads, on lanes or through ZeroMQ;
    without a lane's sealing): what a round's wire format costs on the wire."""
    lane_frames_received: int = 0
    """Data frames read from a payload lane (the rest came through ZeroMQ)."""
    lane_frames_placed: int = 0
    """Lane frames read straight into the round's result buffer (no copy)."""
    links_renewed: int = 0
    """Links whose connection dropped and whose socket was replaced before a round (see
    :attr:`chaos.collectives.links.Link.lost`)."""
    handshake_failures: int = 0
    """Connections that failed the CURVE handshake (a communicator with a cluster key): a
    stranger without the cluster key, or with another one, connecting to this node's data
    endpoint, or this node's link to a neighbour with another key."""
    dropped_unauthenticated: int = 0
    """Frames whose connection's key is not the key the topology gives the member they claim
    to come from (:attr:`Topology.keys <chaos.collectives.topology.Topology.keys>`): a key
    holder sending as another member."""
