"""One allreduce call from start to end: its round's key, buffers, run, failure and result.

Internal to :mod:`chaos.collectives`. :class:`RoundDriver` claims each call's ``(epoch, step)``
(the steps must increase; a failed step is rerun under a new epoch), picks the result and wire
buffers, starts the round (lane offers, the frames that came early, the notices to peers in
another epoch), runs the :class:`~chaos.collectives.algorithms.Round`, tells the neighbours when
it fails, and hands back the result (kept for a neighbour a step behind if asked).
"""

from __future__ import annotations

import torch

from chaos.collectives.algorithms import Round, RoundTransport
from chaos.collectives.buffers import check_tensors, result_buffer
from chaos.collectives.compress import ErrorFeedback
from chaos.collectives.config import CollectiveStats, ReduceOp
from chaos.collectives.inbox import Inbox
from chaos.collectives.int8_round import Int8Round
from chaos.collectives.lane_switch import LaneSwitch
from chaos.collectives.links import CaughtUp, result_of
from chaos.collectives.notices import PeerNotices
from chaos.collectives.peers import PeerSockets
from chaos.collectives.sender import Sender
from chaos.collectives.topology import Topology
from chaos.errors import PeerFailure, ProtocolError, RoundInterrupted

__all__ = ["RoundDriver"]

Key = tuple[int, int]


class RoundDriver:
    """Runs a communicator's allreduce calls, one round each.

    Args:
        transport: What the rounds send and receive through (the communicator).
        stats: The communicator's counters.
        peers: The links (the neighbours told when a round fails).
        lanes: The payload lanes.
        inbox: The frames sorted by round.
        notices: The notices to peers outside the round's data flow.
        sender: Sends the data frames (told the running step, for the named fault).
    """

    def __init__(
        self,
        transport: RoundTransport,
        stats: CollectiveStats,
        peers: PeerSockets,
        lanes: LaneSwitch,
        inbox: Inbox,
        notices: PeerNotices,
        sender: Sender,
    ) -> None:
        self._transport = transport
        self._config = transport.config
        self._stats = stats
        self._peers = peers
        self._lanes = lanes
        self._inbox = inbox
        self._notices = notices
        self._sender = sender
        self._last_key: Key = (-1, -1)
        self._failed_step: int | None = None
        self._wire_cache: dict[torch.dtype, torch.Tensor] = {}

    def allreduce(
        self,
        topo: Topology,
        tensor: torch.Tensor,
        op: ReduceOp,
        timeout_s: float | None,
        out: torch.Tensor | None,
        wire_dtype: str | None,
        step: int | None,
        keep_result: bool,
        feedback: ErrorFeedback | None = None,
        exact_tail: int = 0,
        free_tail: int = 0,
    ) -> torch.Tensor:
        """Allreduces ``tensor`` over ``topo``; see :meth:`Communicator.allreduce
        <chaos.collectives.communicator.Communicator.allreduce>` for the arguments.

        Raises:
            PeerFailure, PeerTimeout, ProtocolError, ValueError, TypeError: as
                :meth:`Communicator.allreduce
                <chaos.collectives.communicator.Communicator.allreduce>`.
        """
        key, acc, run = self._setup_round(
            topo, tensor, op, timeout_s, out, wire_dtype, step, feedback, exact_tail
        )
        if not 0 <= free_tail <= tensor.numel():
            raise ValueError(f"free_tail must be in 0..{tensor.numel()}, not {free_tail}")
        try:
            caught = self._execute_round(run, key, tensor, free_tail)
        except BaseException:
            if feedback is not None:
                feedback.discard()  # the rerun starts from the same residual
            raise
        if feedback is not None:
            feedback.commit()
        self._failed_step = None
        if caught is None:
            return self._finish(tensor, out, acc, keep_result, key[1])
        self._stats.caught_up += 1
        result = self._finish(tensor, out, caught[0], keep_result, key[1])
        # the neighbours still in this round wait for its result from this node
        self._notices.pass_on(key, caught[1])
        return result

    def _setup_round(
        self,
        topo: Topology,
        tensor: torch.Tensor,
        op: ReduceOp,
        timeout_s: float | None,
        out: torch.Tensor | None,
        wire_dtype: str | None,
        step: int | None,
        feedback: ErrorFeedback | None = None,
        exact_tail: int = 0,
    ) -> tuple[Key, torch.Tensor, Round]:
        """Checks an allreduce call and sets up its round.

        Claims the round's ``(epoch, step)``, picks the result and wire buffers, takes in the
        frames that came before the round, and tells the previous epoch's neighbours that this
        node has moved on. Arguments as in :meth:`allreduce`.

        Returns:
            The round's ``(epoch, step)``, its flat result buffer, and the round to execute.

        Raises:
            ValueError, TypeError: bad arguments or a non-increasing (epoch, step).
        """
        timeout = self._config.timeout_s if timeout_s is None else float(timeout_s)
        if not timeout > 0:
            raise ValueError("timeout_s must be > 0")
        acc_dtype, wire = check_tensors(tensor, op, out, wire_dtype, self._config.wire_dtype)
        if not 0 <= exact_tail <= tensor.numel():
            raise ValueError(f"exact_tail must be in 0..{tensor.numel()}, not {exact_tail}")
        key = self._next_key(topo, step)
        self._last_key = key
        self._sender.step = key[1]
        self._stats.allreduces += 1
        src = tensor.detach().reshape(-1)
        acc = result_buffer(tensor, out, acc_dtype)
        run: Round
        if wire == torch.int8:
            run = Int8Round(
                self._transport, topo, key, src, acc, op, timeout, feedback, exact_tail
            )
        else:
            buf = None if wire == acc_dtype else self._wire_buffer(wire, src.numel())
            run = Round(self._transport, topo, key, src, acc, buf, op, timeout)
        self._lanes.choose(src.numel() * run.esize)
        self._lanes.offer(topo.senders(self._config.node_id), key, self._peers.socket)
        self._notices.new_round()
        self._inbox.start_round(key)
        self._notices.announce(key)
        return key, acc, run

    def _execute_round(
        self, run: Round, key: Key, tensor: torch.Tensor, free_tail: int = 0
    ) -> tuple[torch.Tensor, str] | None:
        """Runs the round; on a failure, tells the neighbours and re-raises.

        Args:
            run: The round from :meth:`_setup_round`.
            key: Its ``(epoch, step)``.
            tensor: The call's input (to check a neighbour's kept result against).

        Returns:
            ``None`` when the round completed here, or the result a neighbour sent because this
            node was a step behind (see :attr:`Op.RESULT`), with that neighbour.

        Raises:
            PeerFailure: a neighbour failed, or the round was interrupted; the step is marked
                failed (rerun it under a new epoch) and the neighbours are sent an abort (or,
                for a newer round seen elsewhere, told of that round).
            ProtocolError: a neighbour's frames disagree with this call; handled likewise.
        """
        caught: tuple[torch.Tensor, str] | None = None
        try:
            try:
                run.execute()
            except CaughtUp as done:
                self._lanes.cancel()  # this round's own frames are stale now
                # a bad result fails the round
                caught = (result_of(done.frame, tensor, free_tail), done.frame.peer)
        except BaseException as exc:
            self._lanes.cancel()  # the round's buffers may be reused at once
            if not isinstance(exc, (PeerFailure, ProtocolError)):
                raise
            self._stats.failures += 1
            self._failed_step = key[1]
            newer_round = self._inbox.newer_round
            if isinstance(exc, RoundInterrupted) and newer_round is not None:
                newer = (newer_round, key[1])
                for peer in self._peers.peers():  # pass it on: they cannot complete either
                    self._notices.tell_newer(peer, newer)
            else:
                failed = exc.peer if isinstance(exc, PeerFailure) else self._config.node_id
                self._notices.abort(key, failed)
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

    def _next_key(self, topo: Topology, step: int | None) -> Key:
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
