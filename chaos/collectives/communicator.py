"""The data-plane communicator: the public face of one node's end of the collectives.

A :class:`Communicator` lives in the training process. It binds one ZeroMQ ROUTER socket on its
data endpoint (everything addressed to this node arrives there) and keeps one DEALER socket per
neighbour link of the current :class:`~chaos.collectives.topology.Topology` (everything this node
sends to that neighbour leaves there). :meth:`Communicator.update_topology` edits that set in
place: it opens sockets for new links and closes dead ones, and keeps the others.

The communicator is a facade over collaborators with one job each: the sockets and peer links
(:class:`~chaos.collectives.peers.PeerSockets`), the allreduce calls
(:class:`~chaos.collectives.driver.RoundDriver`, which runs the algorithms of
:mod:`chaos.collectives.algorithms`), sending (:class:`~chaos.collectives.sender.Sender`), the
receive loop with its timeout and interrupt (:class:`~chaos.collectives.receiver.Receiver`),
the sorting of frames by round (:class:`~chaos.collectives.inbox.Inbox`), the notices to peers
in other rounds (:class:`~chaos.collectives.notices.PeerNotices`) and the payload lanes
(:class:`~chaos.collectives.lane_switch.LaneSwitch`). The settings and counters are in
:mod:`chaos.collectives.config` (re-exported here).

With a cluster key (the ``security`` argument) the data plane is authenticated and encrypted:
the endpoint is a CURVE server of the cluster, every link a CURVE client, the payload lanes are
sealed with AES-256-GCM, and a topology that names the members' keys binds each member's frames
to its key (see :mod:`chaos.collectives.peers` and :mod:`chaos.collectives.lanes`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import zmq

from chaos.allocator import keep_frame_memory
from chaos.collectives.compress import ErrorFeedback
from chaos.collectives.config import CollectiveStats, CommunicatorConfig, ReduceOp
from chaos.collectives.driver import RoundDriver
from chaos.collectives.early import EarlyBudget
from chaos.collectives.inbox import Inbox
from chaos.collectives.lane_switch import LaneSwitch
from chaos.collectives.lanes import Place
from chaos.collectives.links import Frame, LanePayload
from chaos.collectives.notices import PeerNotices
from chaos.collectives.peers import PeerSockets
from chaos.collectives.receiver import Interrupt, Receiver
from chaos.collectives.sender import Sender
from chaos.collectives.topology import Topology
from chaos.security import Security

# CommunicatorConfig, CollectiveStats and ReduceOp live in chaos.collectives.config and are
# re-exported here.
__all__ = ["CollectiveStats", "Communicator", "CommunicatorConfig", "ReduceOp"]


class Communicator:
    """One node's end of the data plane.

    Not thread-safe: one thread calls :meth:`allreduce` and :meth:`update_topology`; only
    :meth:`report_dead` may be called from other threads.

    Args:
        config: The settings.
        topology: The initial topology (may be given later with :meth:`update_topology`).
        security: The cluster key and this process's keypair; default: none (plain sockets and
            lanes, anyone who reaches the endpoint can send frames).

    Raises:
        zmq.ZMQError: the listen endpoint cannot be bound.
        ValueError: see :meth:`update_topology`.
    """

    def __init__(
        self,
        config: CommunicatorConfig,
        topology: Topology | None = None,
        *,
        security: Security | None = None,
    ) -> None:
        self.config = config
        self.node_id = config.node_id
        self.stats = CollectiveStats()
        self.security = security if security is not None else Security()
        if config.keep_frame_memory:
            keep_frame_memory(config.chunk_bytes)
        self._early = EarlyBudget(config, self.stats)  # frames kept for later rounds
        self._peers = PeerSockets(config, self.stats, self.security, self._early)
        self.address: str = self._peers.address
        self._topology: Topology | None = None
        self._notices = PeerNotices(
            self._peers.ctx, self.node_id, self.stats, self._peers, self.security
        )
        self._inbox = Inbox(self._early, self.stats, self._notices, self._peers)
        # opened at the first large round
        self._lanes = LaneSwitch(config, self.address, sealed=self.security.enabled)
        self._interrupt = Interrupt(self.node_id)
        self._receiver = Receiver(
            config, self.stats, self._peers, self._lanes, self._inbox, self._interrupt
        )
        self._sender = Sender(self._peers, self._lanes, self.stats)
        self._driver = RoundDriver(
            self, self.stats, self._peers, self._lanes, self._inbox, self._notices, self._sender
        )
        self._closed = False
        if topology is not None:
            self.update_topology(topology)

    # ------------------------------------------------------------------ topology

    @property
    def public_key(self) -> str:
        """This node's CURVE public key (Z85 text): its key in :attr:`Topology.keys`."""
        return self.security.public_key

    @property
    def topology(self) -> Topology | None:
        """The current topology (``None`` before the first :meth:`update_topology`)."""
        return self._topology

    @property
    def early_bytes(self) -> int:
        """The bytes of the frames kept now for later rounds (at most
        :attr:`CommunicatorConfig.max_early_bytes`)."""
        return self._early.held_bytes

    def link_socket(self, peer: str) -> zmq.Socket | None:
        """The DEALER socket of the link to ``peer``, or ``None`` (for inspection and tests)."""
        return self._peers.socket(peer)

    def update_topology(self, topology: Topology) -> None:
        """Switches to a new topology, editing the links in place.

        Links to neighbours that stay (same peer, same address) keep their socket; links that are
        gone are closed; new links are opened. Frames of older epochs still queued are dropped.
        Dead-peer reports are cleared: the new epoch is authoritative.

        Args:
            topology: The new topology; this node must be a member.

        Raises:
            ValueError: this node is not a member, the epoch went backwards, the same epoch
                came with a different structure, or the topology names members' keys while
                this node has no cluster key or another key of its own.
        """
        self._check_open()
        if self.node_id not in topology.addresses:
            raise ValueError(f"{self.node_id!r} is not a member of the topology")
        if topology.keys is not None:
            if not self.security.enabled:
                raise ValueError("the topology names the members' keys: it needs a communicator "
                                 "with a cluster key")  # fmt: skip
            if topology.keys[self.node_id] != self.public_key:
                raise ValueError(f"the topology gives {self.node_id!r} another public key than "
                                 "this communicator's: its frames would be dropped")  # fmt: skip
        old = self._topology
        if old is not None:
            if topology.epoch < old.epoch:
                raise ValueError(f"epoch went backwards: {old.epoch} -> {topology.epoch}")
            if topology.epoch == old.epoch and topology != old:
                raise ValueError(f"epoch {old.epoch} reissued with a different topology")
        if old is not None and topology.epoch > old.epoch:
            # Members still in the old epoch may wait on this node there, so this node's first
            # round in the new epoch tells its old neighbours it has moved on.
            self._notices.announce_later(
                p for p in old.neighbours(self.node_id) if p in topology.addresses
            )
        wanted = {p: topology.addresses[p] for p in topology.neighbours(self.node_id)}
        self._peers.connect(wanted, self._lanes.drop)
        self._topology = topology
        self._early.epoch = topology.epoch
        self._peers.vouch(topology.keys, topology.epoch)
        self._notices.retain(topology.addresses, topology.epoch)
        self._peers.clear_dead()
        self._inbox.drop_older_than(topology.epoch)

    def report_dead(self, peer: str) -> None:
        """Marks a peer dead (e.g. on the daemon's notice); thread-safe.

        A running or later allreduce that needs this peer raises :class:`PeerFailure` (within
        ``poll_slice_s`` for a running one), until the next :meth:`update_topology`.
        """
        self._peers.report_dead(peer)

    def set_interrupt(self, check: Callable[[], str | None] | None, every_s: float = 0.05) -> None:
        """Lets an outside condition abort a blocked allreduce (e.g. a newer membership epoch).

        While an allreduce waits for frames, ``check`` is called at most every ``every_s``
        seconds; when it returns a reason, the allreduce raises :class:`RoundInterrupted`
        (a :class:`PeerFailure`: the input is untouched and the step can be rerun under a new
        epoch).

        Raises:
            ValueError: ``every_s`` is not positive.
        """
        self._interrupt.set(check, every_s)

    def newer_round_seen(self) -> int | None:
        """The newest epoch in which a peer already runs the current allreduce's step, if any.

        Such a peer abandoned (or never started) the current ``(epoch, step)`` round, so this
        round cannot complete anywhere: the step must be rerun under that epoch's policy. The
        trainer's interrupt check uses this, rather than the mere existence of a newer policy,
        because a planned change must not abort a round some member may already have completed.
        """
        return self._inbox.newer_round

    def note_newer_round(self, epoch: int) -> None:
        """Marks the running step as one this node will rerun under structure epoch ``epoch``
        (learned out of band: its daemon restarts the allreduce). When the round is then given
        up, the neighbours are told of that epoch (a NEWER notice) instead of sent an abort."""
        self._inbox.note_newer(epoch)

    def fail_at(
        self, step: int, after_frames: int = 0, before_exit: Callable[[], None] | None = None
    ) -> None:
        """Fault injection by name: exit this process abruptly in the middle of an allreduce.

        The process calls ``os._exit(70)`` during the allreduce of ``step``, once it has sent
        ``after_frames`` data frames of it, as a ``kill -9`` would stop it (no cleanup, sockets
        torn down by the kernel). For tests and emulation only.

        Args:
            step: The allreduce step to die in.
            after_frames: Data frames of that step to send first.
            before_exit: Run just before exiting (e.g. ``kill -9`` of the node's daemon, so
                that the whole device fails at once).

        Raises:
            ValueError: a negative step or frame count.
        """
        if step < 0 or after_frames < 0:
            raise ValueError("step and after_frames must be >= 0")
        self._sender.fail_at(step, after_frames, before_exit)

    def lose_frames_to(self, peer: str, step: int) -> None:
        """Fault injection by name: a lossy link. The data frames this node sends to ``peer``
        in the allreduce of ``step`` are dropped without a word, as a link that loses them
        would (the connection stays up). For tests only.

        Raises:
            ValueError: a negative step or an empty peer id.
        """
        if step < 0 or not peer:
            raise ValueError("lose_frames_to needs a peer id and a step >= 0")
        self._sender.lose_frames_to(peer, step)

    # ------------------------------------------------------------------ allreduce

    def allreduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp = "mean",
        *,
        timeout_s: float | None = None,
        out: torch.Tensor | None = None,
        wire_dtype: str | None = None,
        step: int | None = None,
        keep_result: bool = False,
        feedback: ErrorFeedback | None = None,
        exact_tail: int = 0,
        free_tail: int = 0,
    ) -> torch.Tensor:
        """Allreduces ``tensor`` over the current topology's members.

        The input is never modified: the reduction runs in a separate buffer and the result is
        returned (or copied into ``out`` once complete). Every member ends with a bitwise
        identical result.

        Args:
            tensor: A float32/float64/float16/bfloat16 CPU tensor, same shape on every member.
            op: ``"sum"`` or ``"mean"`` (divides by the member count).
            timeout_s: Progress timeout (see :attr:`CommunicatorConfig.timeout_s`).
            out: Optional output of the same shape and dtype as ``tensor`` (may be ``tensor``
                itself, which is then written only on success).
            wire_dtype: Overrides :attr:`CommunicatorConfig.wire_dtype` for this call; must be
                the same on every member.
            step: The training step; ``(epoch, step)`` must increase from call to call. Default:
                the last step + 1, or the failed step again after a failure (which needs a new
                epoch from :meth:`update_topology`).
            keep_result: Keep a reference to the result until the next call, so that a
                neighbour still running this step (a member died while the result was going
                out, so it never got it) can complete it with this result and stay bitwise
                equal. The caller must not modify the result in place. Pass it on every member,
                or none: a member a step behind can only catch up from one that kept it.
            feedback: With the ``"int8"`` wire format, this member's error feedback for this
                tensor (the same object every call): what the encodings lost is added to the
                next call's input (see :mod:`chaos.collectives.compress`). Ignored otherwise.
            exact_tail: With the ``"int8"`` wire format, the last this many elements travel as
                float32, unrounded (the same on every member). Ignored otherwise.
            free_tail: The last this many elements may differ in length in a result a
                neighbour kept from an earlier attempt at this step under another membership
                (the state audit's digests, one slot per member). Such a result is taken for
                the elements before them, and this call's last ``free_tail`` elements come
                back zero. 0: a kept result must match the input's length exactly.

        Returns:
            The reduced tensor (``out`` when given), or, when this node turns out to be a step
            behind a neighbour that kept that step's result, that result.

        Raises:
            PeerFailure: a neighbour died, was reported dead or sent an abort notice.
            PeerTimeout: a neighbour sent nothing within the timeout (a :class:`PeerFailure`).
            ProtocolError: a neighbour's frames disagree with this call (size, dtype).
            ValueError, TypeError: bad arguments, no topology, or a non-increasing (epoch, step).
        """
        self._check_open()
        topo = self._require_topology()
        self._peers.renew_lost(self._lanes.drop)  # a link that dropped since: a fresh socket
        return self._driver.allreduce(
            topo, tensor, op, timeout_s, out, wire_dtype, step, keep_result, feedback,
            exact_tail, free_tail,
        )

    def _require_topology(self) -> Topology:
        if self._topology is None:
            raise ValueError("no topology yet: call update_topology() first")
        return self._topology

    # ------------------------------------------------------------------ sending

    def send(
        self,
        peer: str,
        header: bytes | zmq.Frame,
        payload: zmq.Frame | memoryview | LanePayload,
        *,
        track: bool = False,
    ) -> zmq.MessageTracker | None:
        """Sends one data frame (header, payload) zero-copy to a neighbour. Used by the
        algorithms.

        The frame goes over the link's payload lane when it has one and the round's tensor
        has at least :attr:`CommunicatorConfig.lane_min_bytes` (the round waits for the lanes to
        drain before it returns, see :meth:`drain_lanes`), else through ZeroMQ.

        Returns:
            A tracker of the ZeroMQ send when ``track`` is set and the frame went that way.

        Raises:
            PeerTimeout: the link's queue stayed full for the whole timeout.
            PeerFailure: no link to ``peer``.
        """
        return self._sender.send(peer, header, payload, track=track)

    def drain_lanes(self, timeout_s: float) -> None:
        """Waits until every frame queued on a payload lane is written (the end of a round:
        after it, the caller may change the buffers they were sent from).

        Raises:
            PeerTimeout: a lane's frames were not all taken within ``timeout_s``.
        """
        self._lanes.drain(timeout_s, self._peers.socket, self.node_id)

    # ------------------------------------------------------------------ receiving

    def recv(
        self,
        key: tuple[int, int],
        timeout_s: float,
        waiting_for: str | Callable[[], str],
        place: Place | None = None,
    ) -> Frame:
        """The next frame of ``key`` from a neighbour. Used by the algorithms.

        Frames of older keys are dropped and counted; frames of newer keys are kept for their
        allreduce; frames from non-neighbours or malformed frames are dropped and counted.

        Args:
            key: The running allreduce's (epoch, step).
            timeout_s: Longest wait for this frame.
            waiting_for: The neighbour blamed if nothing comes (or a function naming it).
            place: For a frame of ``key`` arriving on a payload lane: ``place(peer, header)``
                names the region of the result buffer to read its payload into (the frame is
                then ``placed``), or ``None``. It must check the header (size, a chunk not yet
                received) before naming a region.

        Raises:
            PeerFailure: a neighbour's connection dropped, was reported dead, or sent an abort.
            PeerTimeout: nothing arrived within ``timeout_s``.
        """
        return self._receiver.recv(key, timeout_s, waiting_for, place)

    # ------------------------------------------------------------------ lifecycle

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("communicator is closed")

    def close(self) -> None:
        """Closes every socket and the context. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._peers.close_links(self._lanes.drop)
        self._lanes.close()
        self._notices.close()
        self._peers.close()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
