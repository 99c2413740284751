"""A small synchronous client of a daemon's endpoints (CLI, tests, benchmarks, trainer).

One request is outstanding at a time; a reply that arrives after its request timed out is
discarded before the next request is sent. A client is not thread-safe (one ZeroMQ socket).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from typing import TypeVar, cast

import msgspec
import zmq

from chaos.errors import ChaosTimeout, DaemonGone, ProtocolError
from chaos.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    AnsweredEvent,
    AnsweredEventBase,
    FaultCommand,
    FaultName,
    FaultReply,
    LeaveCommand,
    LinkCommand,
    Message,
    OpResult,
    PolicyReply,
    PolicyRequest,
    Refusal,
    StatusReply,
    StatusRequest,
    TrainerRegister,
    decode,
    encode,
)
from chaos.protocol.ids import check_daemon_endpoint
from chaos.security import HandshakeWatch, Security

R = TypeVar("R")

log = logging.getLogger(__name__)

_GONE_CHECK_S = 0.05
"""How often a request given ``gone`` checks whether the daemon has exited."""
_HANDSHAKE_CHECK_S = 0.1


class RequestRefused(ProtocolError):
    """The daemon or the scheduler refused a request.

    Attributes:
        reason: The reason code (a :class:`~chaos.protocol.Reason` value, e.g.
            ``"state_conflict"``).
        detail: Human-readable detail.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"refused: {reason} {detail}".strip())
        self.reason = reason
        self.detail = detail


def _checked(result: OpResult) -> OpResult:
    """Raises for a failed result: ChaosTimeout for ``timeout``, RequestRefused otherwise."""
    if result.ok:
        return result
    reason = result.reason.value if result.reason is not None else "refused"
    if reason == "timeout":
        raise ChaosTimeout(f"the scheduler did not answer: {result.detail}")
    raise RequestRefused(reason, result.detail)


class DaemonClient:
    """Request/reply over a DEALER to a daemon's IPC or TCP endpoint.

    Args:
        endpoint: ``ipc://PATH`` (the local daemon) or ``tcp://HOST:PORT``.
        timeout_s: Default wait for each reply.
        security: The cluster key and this client's keypair, for a TCP endpoint of a daemon
            started with a cluster key (``None``: plain; the IPC endpoint is always plain).

    Raises:
        ProtocolError: an ``ipc://`` endpoint whose socket file does not exist.
        ConfigError: an endpoint that is neither ``ipc://PATH`` nor ``tcp://HOST:PORT``.
    """

    def __init__(
        self, endpoint: str, timeout_s: float = 15.0, security: Security | None = None
    ) -> None:
        check_daemon_endpoint(endpoint)
        if endpoint.startswith("ipc://") and not os.path.exists(endpoint[len("ipc://") :]):
            raise ProtocolError(f"no daemon listening at {endpoint} (no socket file)")
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._handshake: HandshakeWatch | None = None
        if endpoint.startswith("tcp://"):
            if security is not None:
                security.client(self._sock)
            self._handshake = HandshakeWatch(self._sock)
        self._keyed = security is not None and security.enabled
        self._security = security if security is not None else Security()
        self._sock.connect(endpoint)

    def request(
        self,
        msg: Message,
        timeout_s: float | None = None,
        *,
        gone: Callable[[], bool] | None = None,
        expect: type | None = None,
        op_id: str = "",
    ) -> Message:
        """Sends one request and waits for its answer.

        Args:
            msg: The request.
            timeout_s: Wait at most this long (default: the client's timeout).
            gone: Whether the daemon has exited (e.g. a Trainer's embedded daemon); checked
                every ``_GONE_CHECK_S`` while waiting, so that a request to a daemon that is
                gone fails at once instead of at the timeout.
            expect: The answer's type; an answer of another type (not a refusal either) is
                the late answer of an earlier request that timed out, and is skipped.
            op_id: The request's op id: an :class:`~chaos.protocol.OpResult` for another op is
                the late answer of an earlier one (a trainer event whose answer came after its
                timeout, say), and is skipped too.

        Returns:
            The answer (possibly a :class:`~chaos.protocol.Refusal`).

        Raises:
            ChaosTimeout: no answer in time.
            DaemonGone: ``gone()`` said the daemon exited before it answered.
            ProtocolError: the answer cannot be decoded.
        """
        wait = self.timeout_s if timeout_s is None else timeout_s
        while self._sock.poll(0, zmq.POLLIN):  # the late answer of a request that timed out
            self._sock.recv_multipart()
        self._sock.send(encode(msg))
        deadline = time.monotonic() + wait
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChaosTimeout(f"no answer from {self.endpoint} within {wait:.1f} s")
            slice_s = left if gone is None else min(left, _GONE_CHECK_S)
            if self._handshake is not None:
                slice_s = min(slice_s, _HANDSHAKE_CHECK_S)
            if self._sock.poll(int(slice_s * 1000) + 1, zmq.POLLIN):
                parts = self._sock.recv_multipart()
                answer = decode(parts[-1], DEFAULT_MAX_FRAME_BYTES * 4)
                late_op = op_id and isinstance(answer, OpResult) and answer.op_id != op_id
                if (expect is None or isinstance(answer, (expect, Refusal))) and not late_op:
                    return answer
                log.debug("skipped a late %s answer", type(answer).__name__)
                continue
            self._check_handshake()
            if gone is not None and gone():
                raise DaemonGone(f"the daemon at {self.endpoint} exited before it answered")

    def _check_handshake(self) -> None:
        """Raises when the connection failed its security handshake (a key mismatch)."""
        if self._handshake is None or self._handshake.take() is None:
            return
        if self._keyed:
            hint = "it has no cluster key or another one than this client's --cluster-key"
        else:
            hint = "it uses a cluster key: pass --cluster-key FILE (or set CHAOS_CLUSTER_KEY)"
        raise ProtocolError(f"the daemon at {self.endpoint} refused the connection: {hint}")

    def _expect(
        self,
        msg: Message,
        kind: type,
        timeout_s: float | None = None,
        gone: Callable[[], bool] | None = None,
    ) -> Message:
        op_id = str(getattr(msg, "op_id", ""))
        answer = self.request(msg, timeout_s, gone=gone, expect=kind, op_id=op_id)
        if isinstance(answer, Refusal):
            raise RequestRefused(answer.reason.value, answer.detail)
        if not isinstance(answer, kind):
            raise ProtocolError(f"unexpected answer {type(answer).__name__}")
        return answer

    def ask(self, msg: Message, reply: type[R], timeout_s: float | None = None) -> R:
        """Sends a request and returns its answer of type ``reply`` (a flow's ``call_`` side
        uses it: the request and its handler live together in the flow's module).

        Raises:
            ChaosTimeout: no answer in time.
            RequestRefused: the daemon refused the request (``malformed``: one it does not
                know, such as a newer request sent to an older daemon).
            ProtocolError: an unexpected answer.
        """
        return cast(R, self._expect(msg, reply, timeout_s))

    def status(self, timeout_s: float | None = None) -> StatusReply:
        """The daemon's status."""
        return cast(StatusReply, self._expect(StatusRequest(), StatusReply, timeout_s))

    def op(
        self,
        msg: LeaveCommand | LinkCommand | TrainerRegister | AnsweredEvent,
        timeout_s: float | None = None,
        gone: Callable[[], bool] | None = None,
    ) -> OpResult:
        """Runs a primitive request; returns its result (``ok`` may be ``False``).

        Raises:
            ChaosTimeout: no answer in time.
            DaemonGone: ``gone`` (see :meth:`request`) said the daemon exited first.
            RequestRefused: refused on receipt (e.g. ``paused``, ``malformed``).
            ProtocolError: an unexpected answer.
        """
        if isinstance(msg, (TrainerRegister, AnsweredEventBase)) and not msg.op_id:
            # the daemon answers under this id, so a late answer to an earlier op is told apart
            msg = msgspec.structs.replace(msg, op_id=uuid.uuid4().hex[:12])
        return cast(OpResult, self._expect(msg, OpResult, timeout_s, gone))

    def policy(self, timeout_s: float | None = None) -> PolicyReply:
        """The policies in force at this daemon (``.epoch`` is their epoch).

        Raises:
            ChaosTimeout: no answer in time.
            ProtocolError: refused or an unexpected answer.
        """
        return cast(PolicyReply, self._expect(PolicyRequest(), PolicyReply, timeout_s))

    def register_trainer(
        self,
        data_address: str,
        shard_address: str,
        has_state: bool,
        tensor_sizes: list[int] | None = None,
        timeout_s: float | None = None,
        state_digest: str = "",
        catch_up: bool = False,
    ) -> OpResult:
        """Registers this node's training process with the scheduler (through the daemon).

        Args:
            data_address: The trainer's allreduce endpoint (``tcp://HOST:PORT`` or ``ipc://``).
            shard_address: Its shard server's endpoint.
            has_state: Whether it holds a live training state (``False``: it must receive one).
            tensor_sizes: The byte size of every state tensor, in stream order (with
                ``has_state``; ``None``: not known yet, re-register when it is).
            timeout_s: Wait at most this long (default: the client's timeout).
            state_digest: Hex SHA-256 of a state restored from a checkpoint (stop-resume):
                with ``has_state``, a trainer whose digest equals the first trainer's joins
                a training cluster without replication.
            catch_up: Without ``has_state``: join by catching up (the members train on while
                this trainer pulls a snapshot and replays the steps it missed).

        Returns:
            The scheduler's result; ``epoch`` is the epoch whose policy includes this trainer.

        Raises:
            ChaosTimeout: no answer in time (from the daemon or from the scheduler).
            RequestRefused: refused, e.g. ``state_conflict``, ``no_state_source``, ``paused``,
                ``malformed`` (a bad address or size list).
        """
        reg = TrainerRegister(
            data_address=data_address,
            shard_address=shard_address,
            has_state=has_state,
            tensor_sizes=None if tensor_sizes is None else list(tensor_sizes),
            state_digest=state_digest,
            catch_up=catch_up,
        )
        return self.register(reg, timeout_s)

    def register(self, reg: TrainerRegister, timeout_s: float | None = None) -> OpResult:
        """Registers this node's training process as ``reg`` says (see
        :meth:`register_trainer` for the fields, the result and the errors), as this process,
        and with this client's key as the data plane's key."""
        msg = msgspec.structs.replace(
            reg,
            pid=os.getpid(),  # the daemon watches this process: its exit ends the registration
            # with a cluster key, the data plane's frames are accepted only from this key
            public_key=self._security.public_key if self._security.enabled else "",
        )
        return _checked(self.op(msg, timeout_s))

    def trainer_event(self, event: AnsweredEvent, timeout_s: float | None = None) -> OpResult:
        """Reports a trainer event to the scheduler and waits for its answer.

        Args:
            event: The event: :class:`~chaos.protocol.TrainerReady` (the state is in place;
                its ``step`` is the step it enters at, where the local daemon starts the
                trainer's silence clock, so a trainer stopped before its first progress report
                is still found a straggler), :class:`~chaos.protocol.StepFailed` (an allreduce
                failed and no newer policy is known; ``detail`` names the blamed peer,
                ``epoch`` the epoch the step ran under; the scheduler commits a restart epoch
                if nothing else will), :class:`~chaos.protocol.CaughtUp` or
                :class:`~chaos.protocol.PullDone`. Its ``op_id`` is set when empty.
            timeout_s: Wait at most this long (default: the client's timeout).

        Returns:
            The scheduler's result (``ok``).

        Raises:
            ChaosTimeout: no answer in time.
            RequestRefused: refused (e.g. ``bad_request``: no trainer registered here).
        """
        return _checked(self.op(event, timeout_s))

    def link(self, peer: str, add: bool, timeout_s: float | None = None) -> OpResult:
        """Adds or removes this daemon's link to ``peer``."""
        return self.op(LinkCommand(peer=peer, op="connect" if add else "disconnect"), timeout_s)

    def leave(
        self, timeout_s: float | None = None, gone: Callable[[], bool] | None = None
    ) -> OpResult:
        """Makes the daemon leave the cluster; it exits afterwards.

        Raises:
            ChaosTimeout: no answer in time.
            DaemonGone: ``gone`` (see :meth:`request`) said the daemon exited first.
        """
        return self.op(LeaveCommand(), timeout_s, gone)

    def fault(
        self, name: FaultName, peers: list[str], timeout_s: float | None = None
    ) -> FaultReply:
        """Injects a named transport fault (``clear`` removes all)."""
        return cast(
            FaultReply, self._expect(FaultCommand(name=name, peers=peers), FaultReply, timeout_s)
        )

    def close(self) -> None:
        """Closes the socket."""
        if self._handshake is not None:
            self._handshake.close()
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
