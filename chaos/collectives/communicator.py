"""The data-plane communicator: neighbour sockets, framing, and the allreduce entry point.

A :class:`Communicator` lives in the training process. It binds one ZeroMQ ROUTER socket on its
data endpoint (everything addressed to this node arrives there) and keeps one DEALER socket per
neighbour link of the current :class:`~chaos.collectives.topology.Topology` (everything this node
sends to that neighbour leaves there). :meth:`Communicator.update_topology` edits that set in
place: it opens sockets for new links and closes dead ones, and keeps the others.

The algorithms (ring and pipelined tree) are in :mod:`chaos.collectives.algorithms`, the settings
and counters in :mod:`chaos.collectives.config` (re-exported here), the link and frame records in
:mod:`chaos.collectives.links`; this module owns the sockets, the receive loop with its timeout,
stale-frame filtering and failure handling.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from chaos.allocator import keep_frame_memory
from chaos.collectives import algorithms
from chaos.collectives.buffers import check_tensors, result_buffer
from chaos.collectives.config import CollectiveStats, CommunicatorConfig, ReduceOp
from chaos.collectives.frames import Op, decode_header
from chaos.collectives.lanes import (
    InLane,
    Lanes,
    Place,
    endpoint_host,
    open_lanes,
    read_frame,
)
from chaos.collectives.links import (
    CaughtUp,
    Fault,
    Frame,
    LanePayload,
    Link,
    result_of,
    send_notice,
)
from chaos.collectives.notices import PeerNotices, sort_early
from chaos.collectives.topology import Topology
from chaos.errors import PeerFailure, PeerTimeout, ProtocolError, RoundInterrupted

# CommunicatorConfig, CollectiveStats and ReduceOp live in chaos.collectives.config and are
# re-exported here.
__all__ = ["CollectiveStats", "Communicator", "CommunicatorConfig", "ReduceOp"]

log = logging.getLogger("chaos.collectives")

_MONITOR_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
_MORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_NOBLOCK = int(zmq.NOBLOCK)


class Communicator:
    """One node's end of the data plane.

    Not thread-safe: one thread calls :meth:`allreduce` and :meth:`update_topology`; only
    :meth:`report_dead` may be called from other threads.

    Args:
        config: The settings.
        topology: The initial topology (may be given later with :meth:`update_topology`).

    Raises:
        zmq.ZMQError: the listen endpoint cannot be bound.
        ValueError: see :meth:`update_topology`.
    """

    def __init__(self, config: CommunicatorConfig, topology: Topology | None = None) -> None:
        self.config = config
        self.node_id = config.node_id
        self.stats = CollectiveStats()
        if config.keep_frame_memory:
            keep_frame_memory(config.chunk_bytes)
        self._ctx = zmq.Context(config.io_threads)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted peer takes over its id
        self._router.setsockopt(zmq.RCVHWM, config.sndhwm)
        if config.sock_buf_bytes:
            self._router.setsockopt(zmq.RCVBUF, config.sock_buf_bytes)
        self._router.bind(config.listen)
        self.address: str = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._links: dict[str, Link] = {}
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._topology: Topology | None = None
        self._last_key: tuple[int, int] = (-1, -1)
        self._newer_round: int | None = None
        self._notices = PeerNotices(self._ctx, self.node_id, self.stats)
        self._failed_step: int | None = None
        self._early: deque[Frame] = deque()
        self._ready: deque[Frame] = deque()
        # the previous epoch's neighbours, told of this node's first round in a new epoch
        self._announce: list[str] = []
        self._dead: set[str] = set()
        self._dead_lock = threading.Lock()
        self._interrupt: Callable[[], str | None] | None = None
        self._interrupt_every_s = 0.05
        self._next_interrupt_check = 0.0
        self._fault: Fault | None = None
        self._wire_cache: dict[torch.dtype, torch.Tensor] = {}
        self._closed = False
        self._lanes: Lanes | None = None  # opened at the first round of a large tensor
        self._lanes_wanted = config.lanes
        self._use_lanes = False  # this round's tensor is large enough for the lanes
        if topology is not None:
            self.update_topology(topology)

    # ------------------------------------------------------------------ topology

    @property
    def topology(self) -> Topology | None:
        """The current topology (``None`` before the first :meth:`update_topology`)."""
        return self._topology

    def link_socket(self, peer: str) -> zmq.Socket | None:
        """The DEALER socket of the link to ``peer``, or ``None`` (for inspection and tests)."""
        link = self._links.get(peer)
        return None if link is None else link.socket

    def update_topology(self, topology: Topology) -> None:
        """Switches to a new topology, editing the links in place.

        Links to neighbours that stay (same peer, same address) keep their socket; links that are
        gone are closed; new links are opened. Frames of older epochs still queued are dropped.
        Dead-peer reports are cleared: the new epoch is authoritative.

        Args:
            topology: The new topology; this node must be a member.

        Raises:
            ValueError: this node is not a member, the epoch went backwards, or the same epoch
                came with a different structure.
        """
        self._check_open()
        if self.node_id not in topology.addresses:
            raise ValueError(f"{self.node_id!r} is not a member of the topology")
        old = self._topology
        if old is not None:
            if topology.epoch < old.epoch:
                raise ValueError(f"epoch went backwards: {old.epoch} -> {topology.epoch}")
            if topology.epoch == old.epoch and topology != old:
                raise ValueError(f"epoch {old.epoch} reissued with a different topology")
        if old is not None and topology.epoch > old.epoch:
            # Members still in the old epoch may wait on this node there, and frames may never
            # cross between the two trees (a node waiting for children sends nothing), so this
            # node's first round in the new epoch tells its old neighbours it has moved on.
            self._announce = sorted(
                p for p in old.neighbours(self.node_id) if p in topology.addresses
            )
        wanted = {p: topology.addresses[p] for p in topology.neighbours(self.node_id)}
        for peer in [p for p, link in self._links.items() if wanted.get(p) != link.address]:
            self._close_link(self._links.pop(peer))
        for peer, address in sorted(wanted.items()):
            if peer not in self._links:
                self._links[peer] = self._open_link(peer, address)
        self._topology = topology
        self._notices.retain(set(topology.addresses.values()))
        with self._dead_lock:
            self._dead.clear()
        kept = deque(f for f in self._early if f.header.epoch >= topology.epoch)
        self.stats.dropped_stale += len(self._early) - len(kept)
        self._early = kept

    def _open_link(self, peer: str, address: str) -> Link:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, self.node_id.encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self.config.sndhwm)
        if self.config.sock_buf_bytes:
            sock.setsockopt(zmq.SNDBUF, self.config.sock_buf_bytes)
        monitor = sock.get_monitor_socket(_MONITOR_EVENTS)
        sock.connect(address)
        self._poller.register(monitor, zmq.POLLIN)
        return Link(peer, address, sock, monitor)

    def _close_link(self, link: Link) -> None:
        if self._lanes is not None:
            self._lanes.drop(link.peer)
        self._poller.unregister(link.monitor)
        link.socket.disable_monitor()
        link.monitor.close(linger=0)
        link.socket.close(linger=0)

    def report_dead(self, peer: str) -> None:
        """Marks a peer dead (e.g. on the daemon's notice); thread-safe.

        A running or later allreduce that needs this peer raises :class:`PeerFailure` (within
        ``poll_slice_s`` for a running one), until the next :meth:`update_topology`.
        """
        with self._dead_lock:
            self._dead.add(peer)

    def set_interrupt(self, check: Callable[[], str | None] | None, every_s: float = 0.05) -> None:
        """Lets an outside condition abort a blocked allreduce (e.g. a newer membership epoch).

        While an allreduce waits for frames, ``check`` is called at most every ``every_s``
        seconds; when it returns a reason, the allreduce raises :class:`RoundInterrupted`
        (a :class:`PeerFailure`: the input is untouched and the step can be rerun under a new
        epoch).

        Raises:
            ValueError: ``every_s`` is not positive.
        """
        if not every_s > 0:
            raise ValueError("every_s must be > 0")
        self._interrupt = check
        self._interrupt_every_s = float(every_s)

    def newer_round_seen(self) -> int | None:
        """The newest epoch in which a peer already runs the current allreduce's step, if any.

        Such a peer abandoned (or never started) the current ``(epoch, step)`` round, so this
        round cannot complete anywhere: the step must be rerun under that epoch's policy. The
        trainer's interrupt check uses this, rather than the mere existence of a newer policy,
        because a planned change must not abort a round some member may already have completed.
        """
        return self._newer_round

    def note_newer_round(self, epoch: int) -> None:
        """Marks the running step as one this node will rerun under structure epoch ``epoch``
        (learned out of band: its daemon restarts the allreduce). When the round is then given
        up, the neighbours are told of that epoch (a NEWER notice) instead of sent an abort."""
        self._newer_round = max(self._newer_round or 0, epoch)

    def _check_interrupt(self) -> None:
        if self._interrupt is None:
            return
        now = time.monotonic()
        if now < self._next_interrupt_check:
            return
        self._next_interrupt_check = now + self._interrupt_every_s
        reason = self._interrupt()
        if reason:
            raise RoundInterrupted(reason, reported_by=self.node_id)

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
        self._fault = Fault(step, after_frames, before_exit)

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

        Returns:
            The reduced tensor (``out`` when given), or, when this node turns out to be a step
            behind a neighbour that kept that step's result, that result.

        Raises:
            PeerFailure: a neighbour died, was reported dead or sent an abort notice.
            PeerTimeout: a neighbour sent nothing within the timeout (a :class:`PeerFailure`).
            ProtocolError: a neighbour's frames disagree with this call (size, dtype).
            ValueError, TypeError: bad arguments, no topology, or a non-increasing (epoch, step).
        """
        key, acc, run = self._setup_round(tensor, op, timeout_s, out, wire_dtype, step)
        caught = self._execute_round(run, key, tensor)
        self._failed_step = None
        if caught is not None:
            self.stats.caught_up += 1
            acc = caught
        return self._finish(tensor, out, acc, keep_result, key[1])

    def _setup_round(
        self,
        tensor: torch.Tensor,
        op: ReduceOp,
        timeout_s: float | None,
        out: torch.Tensor | None,
        wire_dtype: str | None,
        step: int | None,
    ) -> tuple[tuple[int, int], torch.Tensor, algorithms.Round]:
        """Checks an :meth:`allreduce` call and sets up its round.

        Claims the round's ``(epoch, step)``, picks the result and wire buffers, takes in the
        frames that came before the round, and tells the previous epoch's neighbours that this
        node has moved on. Arguments as in :meth:`allreduce`.

        Returns:
            The round's ``(epoch, step)``, its flat result buffer, and the round to execute.

        Raises:
            ValueError, TypeError: bad arguments, no topology, or a non-increasing (epoch, step).
        """
        self._check_open()
        topo = self._require_topology()
        timeout = self.config.timeout_s if timeout_s is None else float(timeout_s)
        if not timeout > 0:
            raise ValueError("timeout_s must be > 0")
        acc_dtype, wire = check_tensors(tensor, op, out, wire_dtype, self.config.wire_dtype)
        key = self._next_key(topo, step)
        self._last_key = key
        self.stats.allreduces += 1
        src = tensor.detach().reshape(-1)
        acc = result_buffer(tensor, out, acc_dtype)
        buf = None if wire == acc_dtype else self._wire_buffer(wire, src.numel())
        run = algorithms.Round(self, topo, key, src, acc, buf, op, timeout)
        self._use_lanes = self._lanes_ready(src.numel() * run.esize)
        self._start_round(key)
        announce, self._announce = self._announce, []
        for peer in announce:
            self._tell_newer(peer, key)
        return key, acc, run

    def _execute_round(
        self, run: algorithms.Round, key: tuple[int, int], tensor: torch.Tensor
    ) -> torch.Tensor | None:
        """Runs the round; on a failure, tells the neighbours and re-raises.

        Args:
            run: The round from :meth:`_setup_round`.
            key: Its ``(epoch, step)``.
            tensor: The call's input (to check a neighbour's kept result against).

        Returns:
            ``None`` when the round completed here, or the result a neighbour sent because this
            node was a step behind (see :attr:`Op.RESULT`).

        Raises:
            PeerFailure: a neighbour failed, or the round was interrupted; the step is marked
                failed (rerun it under a new epoch) and the neighbours are sent an abort (or,
                for a newer round seen elsewhere, told of that round).
            ProtocolError: a neighbour's frames disagree with this call; handled likewise.
        """
        caught: torch.Tensor | None = None
        try:
            try:
                run.execute()
            except CaughtUp as done:
                self._cancel_lanes()  # this round's own frames are stale now
                caught = result_of(done.frame, tensor)  # a bad result fails the round
        except BaseException as exc:
            self._cancel_lanes()  # the round's buffers may be reused at once
            if not isinstance(exc, (PeerFailure, ProtocolError)):
                raise
            self.stats.failures += 1
            self._failed_step = key[1]
            if isinstance(exc, RoundInterrupted) and self._newer_round is not None:
                newer = (self._newer_round, key[1])
                for peer in list(self._links):  # pass it on: they cannot complete either
                    self._tell_newer(peer, newer)
            else:
                self._send_abort(key, exc)
            raise
        return caught

    def _finish(
        self,
        tensor: torch.Tensor,
        out: torch.Tensor | None,
        acc: torch.Tensor,
        keep: bool,
        step: int,
    ) -> torch.Tensor:
        """The call's return value from the round's result; kept for a neighbour if asked."""
        result = acc.view(tensor.shape)
        if out is None:
            result = result if result.dtype == tensor.dtype else result.to(tensor.dtype)
        else:
            if result.data_ptr() != out.data_ptr():
                out.copy_(result)
            result = out
        self._notices.keep(step, result if keep else None)
        return result

    def _wire_buffer(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A reused wire-format buffer: every send from it has left when a round ends."""
        buf = self._wire_cache.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype)
            self._wire_cache[dtype] = buf
        return buf[:numel]

    def _require_topology(self) -> Topology:
        if self._topology is None:
            raise ValueError("no topology yet: call update_topology() first")
        return self._topology

    def _next_key(self, topo: Topology, step: int | None) -> tuple[int, int]:
        if step is None:
            last = self._last_key[1]
            step = self._failed_step if self._failed_step is not None else last + 1
        if step < 0:
            raise ValueError("step must be >= 0")
        key = (topo.epoch, step)
        if key <= self._last_key:
            raise ValueError(
                f"(epoch, step) {key} does not follow {self._last_key}: after a failure, call "
                "update_topology() with a new epoch before rerunning the step"
            )
        return key

    def _lanes_ready(self, wire_bytes: int) -> bool:
        """Whether this round's chunks take the lanes (opening them at the first such round)."""
        if not self._lanes_wanted or wire_bytes < self.config.lane_min_bytes:
            return False
        if self._lanes is None:
            cfg = self.config
            self._lanes = open_lanes(self.node_id, self.address, cfg.timeout_s, cfg.poll_slice_s)
            self._lanes_wanted = self._lanes is not None  # do not try again every round
        return self._lanes is not None

    def _start_round(self, key: tuple[int, int]) -> None:
        if self._lanes is not None and self._use_lanes:  # offered at the first large round
            for peer in self._require_topology().senders(self.node_id):
                link = self._links.get(peer)
                if link is not None and self._lanes.wants_offer(peer):
                    send_notice(link.socket, Op.LANE, key, self._lanes.offer(peer))
        self._notices.new_round()
        early = sort_early(self._early, key)
        self._ready, self._early, self._newer_round = early.ready, early.later, early.newer_epoch
        self.stats.dropped_stale += early.stale
        for peer in early.stale_peers:
            self._tell_newer(peer, key)

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
        link = self._links.get(peer)
        if link is None:
            raise PeerFailure(peer, "no link to this peer in the current topology")
        if self._use_lanes and self._lanes is not None:
            raw = header.bytes if isinstance(header, zmq.Frame) else header
            if self._lanes.send(link.socket, peer, raw, payload):
                self.stats.lane_frames_sent += 1
                if self._fault is not None:
                    self._count_fault()
                return None
        try:
            link.socket.send(header, _MORE_NOBLOCK, copy=True)
            if isinstance(payload, LanePayload):  # it may lie in the result: copy, untracked
                tracker = link.socket.send(payload.buffer, _NOBLOCK, copy=True)
            else:
                tracker = link.socket.send(payload, _NOBLOCK, copy=False, track=track)
        except zmq.Again:
            raise PeerTimeout(peer, "send queue full") from None
        if self._fault is not None:
            self._count_fault()
        return tracker if track else None

    def _count_fault(self) -> None:
        fault = self._fault
        if fault is None or self._last_key[1] != fault.step:
            return
        fault.sent += 1
        if fault.sent > fault.after_frames:
            if fault.before_exit is not None:
                fault.before_exit()
            os._exit(70)

    def _tell_newer(self, peer: str, key: tuple[int, int]) -> None:
        """Tells a peer still in an older epoch of this step that we run it under ``key``
        (see :meth:`PeerNotices.tell_newer`)."""
        topo = self._topology
        address = topo.addresses.get(peer) if topo is not None else None
        self._notices.tell_newer(peer, key, self._link_socket(peer), address)

    def drain_lanes(self, timeout_s: float) -> None:
        """Waits until every frame queued on a payload lane is written (the end of a round:
        after it, the caller may change the buffers they were sent from).

        Raises:
            PeerTimeout: a lane's frames were not all taken within ``timeout_s``.
        """
        if self._lanes is None:
            return
        peer = self._lanes.drain(timeout_s, self._link_socket)
        if peer is not None:
            raise PeerTimeout(peer, "final frames not taken", reported_by=self.node_id)

    def _cancel_lanes(self) -> None:
        """Drops the frames the lanes have not started to write (see :meth:`Lanes.cancel`)."""
        if self._lanes is not None:
            self._lanes.cancel(min(1.0, self.config.timeout_s))

    def _send_abort(self, key: tuple[int, int], exc: Exception) -> None:
        failed = exc.peer if isinstance(exc, PeerFailure) else self.node_id
        self._notices.abort(key, failed, [link.socket for link in self._links.values()])

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
        while self._ready:  # frames that came before this round started
            early = self._accept(self._ready.popleft())
            if early is not None:
                return early
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                parts = self._router.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:
                lane = self._wait(deadline, waiting_for)
                if lane is not None:
                    frame = self._read_lane(lane, key, timeout_s, place)
                    if frame is not None:
                        return frame
                continue
            frame = self._classify(parts, key)
            if frame is not None:
                return frame

    def _wait(self, deadline: float, waiting_for: str | Callable[[], str]) -> InLane | None:
        """Polls until something arrives (or a slice passes); a readable lane is returned."""
        self._check_dead()
        left = deadline - time.monotonic()
        if left <= 0:
            peer = waiting_for if isinstance(waiting_for, str) else waiting_for()
            raise PeerTimeout(peer, "no frame within the timeout", reported_by=self.node_id)
        if self._lanes is not None:
            self._lanes.resend_dead(self._link_socket)
            self._lanes.sync_poller(self._poller)
        events = dict(self._poller.poll(max(1, int(min(left, self.config.poll_slice_s) * 1000))))
        for link in self._links.values():
            if link.monitor in events:
                self._drain_monitor(link)
        lane = None
        if self._lanes is not None and events:
            lane = self._lanes.on_readable({k for k in events if isinstance(k, int)})
        self._check_dead()
        self._check_interrupt()
        return lane

    def _read_lane(
        self, lane: InLane, key: tuple[int, int], timeout_s: float, place: Place | None
    ) -> Frame | None:
        """Reads one frame from a readable lane (see :func:`~chaos.collectives.lanes.read_frame`).

        A malformed header, or a stream that ends, closes the lane (the neighbour is offered a
        new one at the next round; a peer that died is noticed on ZeroMQ).

        Raises:
            PeerTimeout: the stream stopped in the middle of a frame.
            PeerFailure: a neighbour was reported dead or disconnected, or the round was
                interrupted, while the frame was being read.
        """
        deadline = time.monotonic() + timeout_s
        try:
            got = read_frame(lane, key, deadline, self.config.poll_slice_s, place,
                             self.config.chunk_bytes, self._between_slices)  # fmt: skip
        except BaseException:
            if self._lanes is not None:  # a frame read halfway: the stream is cut
                self._lanes.close_incoming(lane.peer)
            raise
        if isinstance(got, Frame):
            self.stats.frames_received += 1
            self.stats.lane_frames_received += 1
            self.stats.lane_frames_placed += got.placed
            return self._route(got, key)
        if self._lanes is not None:
            self._lanes.close_incoming(lane.peer)
        if got == "timeout":
            raise PeerTimeout(lane.peer, "a frame stopped halfway", reported_by=self.node_id)
        if got != "closed":
            log.warning("lane from %s closed: %s", lane.peer, got)
            self.stats.dropped_malformed += 1
        return None  # the stream ended: a failure shows on ZeroMQ

    def _between_slices(self) -> None:
        """While a lane frame is read: the checks a poll slice makes (a peer reported dead or
        disconnected, an interrupt).

        Raises:
            PeerFailure: as :meth:`recv`.
        """
        for link in self._links.values():
            self._drain_monitor(link)
        self._check_dead()
        self._check_interrupt()

    def _link_socket(self, peer: str) -> zmq.Socket | None:
        link = self._links.get(peer)
        return None if link is None else link.socket

    def _drain_monitor(self, link: Link) -> None:
        while link.monitor.poll(0):
            event = recv_monitor_message(link.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                link.connected, link.lost = True, False
            elif event == zmq.EVENT_DISCONNECTED and link.connected:
                link.lost = True

    def _check_dead(self) -> None:
        with self._dead_lock:
            dead = sorted(self._dead & self._links.keys())
        if dead:
            raise PeerFailure(dead[0], "reported dead", reported_by=self.node_id)
        for link in self._links.values():
            if link.lost:
                raise PeerFailure(link.peer, "connection lost", reported_by=self.node_id)

    def _classify(self, parts: list[zmq.Frame], key: tuple[int, int]) -> Frame | None:
        self.stats.frames_received += 1
        if len(parts) != 3:
            self.stats.dropped_malformed += 1
            return None
        try:
            peer = parts[0].bytes.decode()
            header = decode_header(parts[1].buffer)
        except (ProtocolError, UnicodeDecodeError):
            self.stats.dropped_malformed += 1
            return None
        if header.op == Op.LANE:
            self._on_offer(peer, parts[2])
            return None
        return self._route(Frame(peer, header, parts[1], parts[2]), key)

    def _on_offer(self, peer: str, payload: zmq.Frame) -> None:
        """A neighbour offers a payload lane: connect to it (in the lane's own thread)."""
        link = self._links.get(peer)
        if self._lanes is None or link is None:
            return
        try:
            self._lanes.on_offer(peer, endpoint_host(link.address), payload.buffer)
        except ProtocolError:
            self.stats.dropped_malformed += 1

    def _route(self, frame: Frame, key: tuple[int, int]) -> Frame | None:
        """Sorts a well-formed frame: this round's (returned), a later round's (kept), an older
        round's (dropped, with the notices that help its sender), or a notice (applied)."""
        peer, header = frame.peer, frame.header
        k = header.key
        if header.op == Op.NEWER:
            if k[1] == key[1] and k[0] > key[0]:
                self._newer_round = max(self._newer_round or 0, k[0])
            elif k[1] > key[1] and len(self._early) < self.config.max_early_frames:
                self._early.append(frame)  # a later step's
            return None
        if k[1] == key[1] - 1:
            # the peer still runs the step this node completed: it never got that round's
            # result (a member died while it was going out); send it the kept result
            self.stats.dropped_stale += 1
            self._notices.offer_result(peer, k, self._link_socket(peer))
            return None
        if header.op == Op.BEHIND:
            return None  # about a step this node did not just complete
        if k < key:
            self.stats.dropped_stale += 1
            if k[1] == key[1]:
                self._tell_newer(peer, key)
            return None
        if k > key:
            if k[1] == key[1] and k[0] > key[0]:
                # A peer runs this same step under a newer epoch: it never completes (and
                # never will complete) the round we are in, so nobody can; see newer_round_seen.
                self._newer_round = max(self._newer_round or 0, k[0])
            elif k[1] == key[1] + 1:
                # the peer completed our step: this node missed it
                self._notices.ask_result(peer, key, self._link_socket(peer))
            if len(self._early) >= self.config.max_early_frames:
                self.stats.dropped_early_overflow += 1
            else:
                self.stats.early_buffered += 1
                self._early.append(frame)
            return None
        return self._accept(frame)

    def _accept(self, frame: Frame) -> Frame | None:
        """A frame of the running round: dropped if not from a neighbour; an abort raises.

        Raises:
            PeerFailure: the frame is a neighbour's abort of this round.
        """
        if frame.peer not in self._links:
            self.stats.dropped_unknown_peer += 1
            return None
        if frame.header.op == Op.ABORT:
            failed = frame.payload.bytes.decode(errors="replace")[:64] or frame.peer
            raise PeerFailure(failed, "aborted by a neighbour", reported_by=frame.peer)
        if frame.header.op == Op.RESULT:
            raise CaughtUp(frame)
        return frame

    # ------------------------------------------------------------------ lifecycle

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("communicator is closed")

    def close(self) -> None:
        """Closes every socket and the context. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for link in self._links.values():
            self._close_link(link)
        self._links.clear()
        if self._lanes is not None:
            self._lanes.close()
        self._notices.close()
        self._router.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
