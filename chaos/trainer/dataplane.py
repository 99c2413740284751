"""The trainer's data plane: the allreduce communicator and the shard server.

A :class:`DataPlane` opens both endpoints on one host, on ephemeral ports or on the first free
ports of a configured range (the trainer registers them with its daemon), installs a policy's
allreduce topology at a step boundary, runs the step's allreduce, and publishes the snapshot a
donor serves. It knows nothing of the daemon: the interrupt check it runs while blocked in an
allreduce is handed to it. With a cluster key (``security``) both endpoints are CURVE servers
of the cluster and the payload lanes are sealed (see :mod:`chaos.collectives.communicator` and
:mod:`chaos.replication.server`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
import zmq

from chaos.collectives import (
    CollectiveStats,
    Communicator,
    CommunicatorConfig,
    ErrorFeedback,
    Topology,
)
from chaos.collectives.config import DEFAULT_MAX_EARLY_BYTES
from chaos.errors import ConfigError
from chaos.replication.server import ShardServer, ShardServerConfig
from chaos.replication.state import TrainingState
from chaos.replication.steplog import StepLog
from chaos.security import Security

__all__ = ["DataPlane"]

_T = TypeVar("_T")

log = logging.getLogger("chaos.trainer")


class DataPlane:
    """The allreduce communicator and the shard server of one trainer.

    Args:
        node_id: This node's id.
        host: Interface both endpoints bind to (and advertise).
        chunk_bytes: Allreduce frame size; see :class:`CommunicatorConfig`.
        step_timeout_s: Longest wait for the next allreduce frame.
        wire_dtype: Gradient wire format (``None``, ``"float16"``, ``"bfloat16"`` or ``"int8"``,
            which keeps this member's error feedback from step to step).
        lanes: Send gradient chunks over plain TCP payload lanes beside ZeroMQ.
        poll_interval_s: How often ``interrupt`` runs while blocked in an allreduce.
        interrupt: Run while blocked in an allreduce; a reason string abandons the round
            (:class:`~chaos.errors.RoundInterrupted`), ``None`` goes on waiting.
        ports: ``(first, last)``, inclusive: both endpoints bind the first free ports of this
            range (ports in use by other sockets are skipped); ``None``: ephemeral ports.
        security: The cluster key and this process's keypair (default: none, plain sockets).
        max_early_bytes: Most bytes of frames the communicator keeps for a later round (see
            :attr:`CommunicatorConfig.max_early_bytes`).

    Raises:
        ConfigError: an endpoint could not be bound (every port of ``ports`` in use, or a bad
            host); the message names the ports and the option to change.
    """

    def __init__(
        self,
        node_id: str,
        host: str,
        *,
        chunk_bytes: int,
        step_timeout_s: float,
        wire_dtype: str | None,
        lanes: bool,
        poll_interval_s: float,
        interrupt: Callable[[], str | None],
        ports: tuple[int, int] | None = None,
        security: Security | None = None,
        max_early_bytes: int = DEFAULT_MAX_EARLY_BYTES,
    ) -> None:
        self._host, self._ports = host, ports
        self.security = security if security is not None else Security()
        self._busy: list[int] = []

        def open_comm(listen: str) -> Communicator:
            return Communicator(
                CommunicatorConfig(
                    node_id,
                    listen=listen,
                    chunk_bytes=chunk_bytes,
                    timeout_s=step_timeout_s,
                    wire_dtype=wire_dtype,
                    lanes=lanes,
                    poll_slice_s=min(0.1, poll_interval_s),
                    max_early_bytes=max_early_bytes,
                ),
                security=self.security,
            )

        comm = self._bind("allreduce endpoint", open_comm, self._candidates(skip=None))
        comm.set_interrupt(interrupt, poll_interval_s)
        try:
            server = self._bind(
                "shard server",
                lambda listen: ShardServer(ShardServerConfig(listen=listen),
                                           security=self.security),  # fmt: skip
                self._candidates(skip=comm.address),
            )
        except BaseException:
            comm.close()
            raise
        self._comm = comm
        self._server = server
        self._feedback = ErrorFeedback() if wire_dtype == "int8" else None

    def _candidates(self, skip: str | None) -> Iterator[str]:
        """The endpoints to try, in order: the range's ports (but the one ``skip`` holds), or
        one ephemeral port."""
        if self._ports is None:
            yield f"tcp://{self._host}:*"
            return
        taken = int(skip.rsplit(":", 1)[1]) if skip is not None else -1
        for port in range(self._ports[0], self._ports[1] + 1):
            if port != taken:
                yield f"tcp://{self._host}:{port}"

    def _bind(self, what: str, open_at: Callable[[str], _T], endpoints: Iterator[str]) -> _T:
        """``open_at(endpoint)`` for the first endpoint whose port is free.

        Raises:
            ConfigError: every port in use, or another bind failure (named, with the option).
        """
        for listen in endpoints:
            try:
                return open_at(listen)
            except (zmq.ZMQError, ConfigError) as exc:
                cause = exc if isinstance(exc, zmq.ZMQError) else exc.__cause__
                if not (isinstance(cause, zmq.ZMQError) and cause.errno == zmq.EADDRINUSE):
                    raise ConfigError(
                        f"cannot bind the trainer's {what} to {listen}: {cause or exc}; check "
                        "TrainerConfig.host and TrainerConfig.data_ports"
                    ) from exc
                self._busy.append(int(listen.rsplit(":", 1)[1]))
        lo, hi = self._ports if self._ports is not None else (0, 0)
        raise ConfigError(
            f"no free port for the trainer's {what} in data_ports=({lo}, {hi}) on {self._host}: "
            f"port(s) {sorted(set(self._busy))} already in use by other sockets; choose a "
            "TrainerConfig.data_ports range with 2 ports no other program listens on (the "
            "allreduce endpoint and the shard server), or data_ports=None for ephemeral ports"
        )

    @property
    def address(self) -> str:
        """The allreduce endpoint."""
        return self._comm.address

    @property
    def public_key(self) -> str:
        """This trainer's CURVE public key (Z85 text): what its peers see as its connections'
        key, and its entry in a keyed topology."""
        return self.security.public_key

    @property
    def shard_address(self) -> str:
        """The shard server's endpoint."""
        return self._server.address

    @property
    def stats(self) -> CollectiveStats:
        """The communicator's counters (frames received and dropped, by reason: refused in the
        handshake, unauthenticated, kept for a later round or dropped as too far ahead or over
        the bytes bound, ...)."""
        return self._comm.stats

    @property
    def topology(self) -> Topology | None:
        """The installed allreduce topology."""
        return self._comm.topology

    @property
    def topology_epoch(self) -> int:
        """The epoch of the installed data-plane structure (what this node's frames carry);
        ``-1`` before the first install."""
        topo = self._comm.topology
        return topo.epoch if topo is not None else -1

    def install(self, topology: Topology) -> None:
        """Installs a policy's topology at a step boundary (sockets edited in place).

        An epoch that kept the structure (same topology) leaves the sockets and any round in
        flight alone.
        """
        if topology != self._comm.topology:
            self._comm.update_topology(topology)

    # ------------------------------------------------------------------ the allreduce

    def allreduce(
        self, flat: torch.Tensor, step: int, exact_tail: int = 0, free_tail: int = 0
    ) -> tuple[torch.Tensor, bool]:
        """Sums ``flat`` over the members for ``step`` (the trainer divides by the sample
        count the buffer's last element carries).

        With the int8 wire format the last ``exact_tail`` elements (the sample count and an
        audit's digests) travel unrounded, and the others with this member's error feedback.

        ``keep_result``: a member that never got this step's result (a member died while it was
        going out) completes the step with it, so the survivors stay equal. The last
        ``free_tail`` elements (the audit's digests) of such a result may have another length
        (it was kept under another membership): they then come back zero.

        Returns:
            The sum, and whether this node caught up with a result a peer kept.

        Raises:
            RoundInterrupted: the interrupt check abandoned the round.
            PeerFailure: a neighbour failed or timed out.
        """
        caught_up = self._comm.stats.caught_up
        out = self._comm.allreduce(flat, "sum", step=step, keep_result=True,
                                   feedback=self._feedback, exact_tail=exact_tail,
                                   free_tail=free_tail)  # fmt: skip
        return out, self._comm.stats.caught_up > caught_up

    def newer_round_seen(self) -> int | None:
        """The newest epoch in which a peer already runs the current allreduce's step, if any."""
        return self._comm.newer_round_seen()

    def note_newer_round(self, epoch: int) -> None:
        """Marks the running step as one this node will rerun under structure epoch ``epoch``
        (learned out of band: its daemon restarts the allreduce)."""
        self._comm.note_newer_round(epoch)

    def fail_at(self, step: int, after_frames: int, before_exit: Callable[[], None] | None) -> None:
        """Fault injection: exit abruptly mid-allreduce of ``step``
        (:meth:`Communicator.fail_at`).

        Raises:
            ValueError: a negative step or frame count.
        """
        self._comm.fail_at(step, after_frames, before_exit)

    def die_serving_after(self, shards: int, before_exit: Callable[[], None] | None) -> None:
        """Fault injection: exit abruptly at the shard request after ``shards`` more were sent
        (:meth:`ShardServer.die_after`).

        Raises:
            ValueError: a negative shard count.
        """
        self._server.die_after(shards, before_exit)

    # ------------------------------------------------------------------ snapshots

    def publish(self, state: TrainingState, epoch: int, step: int) -> None:
        """Serves ``state`` as the snapshot of ``(epoch, step)`` to joiners."""
        self._server.publish(state, epoch, step)

    def also_serve(self, epoch: int, step: int) -> bool:
        """Serves the snapshot of ``step`` as the state of ``epoch`` too (see
        :meth:`chaos.replication.server.ShardServer.also_serve`)."""
        return self._server.also_serve(epoch, step)

    def retire(self) -> None:
        """Stops serving the snapshot (the state is about to change)."""
        self._server.retire()

    def set_step_log(self, log: StepLog | None) -> None:
        """Serves a catch-up join's step log (``None``: none)."""
        self._server.set_step_log(log)

    def close(self) -> None:
        """Closes the shard server, then the communicator (best effort)."""
        for part in (self._server, self._comm):
            try:
                part.close()
            except Exception as exc:  # noqa: BLE001 - best effort on shutdown
                log.debug("close: %s", exc)
