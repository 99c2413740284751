"""The step log of a catch-up join: what a joiner needs to replay the steps it missed.

A catch-up join (``TrainerConfig.join_mode = "catch-up"``) pulls a snapshot of the state at step
``s0`` while the members train on. From ``s0`` on, each donor logs every step it takes: the
allreduce's result (the summed, sample-weighted gradient buffer every member installs, its weight
last) and the optimizer's hyperparameters the step ran with. The joiner fetches the log from its
donors' shard servers (:func:`fetch_steps`) and runs the same optimizer step on the same
gradients, so its parameters and optimizer state follow the members' bit for bit (see
``docs/state.md``, *Catch-up joins*). When the scheduler puts the joiner into the data plane, each
donor closes its log at the step boundary where it installs that policy (``closed_at``): the
joiner replays up to there and then pulls only the chunks that still differ.

:class:`StepLog` is the donor's side: bounded by bytes, thread-safe (the trainer appends, the
shard server's thread reads).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from chaos.errors import ReplicationError
from chaos.protocol.messages import Reason, Refusal
from chaos.replication.wire import (
    StepEntry,
    StepLogReply,
    StepLogRequest,
    refusal,
)
from chaos.security import Security

__all__ = ["LoggedStep", "StepLog", "decode_hypers", "encode_hypers", "fetch_steps"]

MAX_REPLY_BYTES = 64 << 20
"""A step-log reply carries entries up to about this many payload bytes (at least one)."""


def encode_hypers(optimizer: torch.optim.Optimizer) -> bytes:
    """The optimizer's hyperparameters now (each param group without ``params``), msgpack.

    Raises:
        TypeError: a hyperparameter is not a plain value (a tensor learning rate).
    """
    from chaos.replication.runtime import check_plain

    groups = []
    for g, group in enumerate(optimizer.param_groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        check_plain(hyper, f"optimizer.param_groups[{g}]")
        groups.append(hyper)
    return msgspec.msgpack.encode(groups)


def decode_hypers(raw: bytes, optimizer: torch.optim.Optimizer) -> None:
    """Sets the optimizer's hyperparameters to the logged ones.

    Raises:
        ReplicationError: the record is malformed or has another number of param groups.
    """
    from chaos.replication.runtime import to_tuples

    try:
        groups = msgspec.msgpack.decode(raw)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
        raise ReplicationError(f"malformed logged hyperparameters: {exc}") from exc
    ok = isinstance(groups, list) and all(isinstance(g, dict) for g in groups)
    if not ok or len(groups) != len(optimizer.param_groups):
        raise ReplicationError("logged hyperparameters of another optimizer layout")
    for group, hyper in zip(optimizer.param_groups, groups, strict=True):
        for key, value in hyper.items():
            if key != "params":
                group[key] = to_tuples(value)


@dataclass(frozen=True)
class LoggedStep:
    """One step as a joiner replays it: install ``grads`` (see
    :meth:`chaos.trainer.gradients.GradientPacker.install`), set ``hypers``, step."""

    step: int
    grads: torch.Tensor
    hypers: bytes


class StepLog:
    """A donor's log of the steps since a catch-up snapshot.

    Args:
        target: The joiner it is for.
        start: The snapshot's step: the first step logged is ``start`` (the update that takes
            the state from ``start`` to ``start + 1``).
        max_bytes: The log stops (``stopped``) rather than hold more gradient bytes than this:
            the joiner then pulls what differs when it enters, like a barrier join.
    """

    def __init__(self, target: str, start: int, max_bytes: int) -> None:
        self.target = target
        self.start = start
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._entries: list[tuple[torch.Tensor, bytes]] = []
        self._bytes = 0
        self.closed_at: int | None = None
        self.stopped = ""
        """Why the log stopped growing before it was closed (``""``: it did not)."""

    @property
    def head(self) -> int:
        """The next step the log would hold."""
        with self._lock:
            return self.start + len(self._entries)

    @property
    def nbytes(self) -> int:
        """Gradient bytes held."""
        return self._bytes

    def append(self, step: int, grads: torch.Tensor, hypers: bytes) -> bool:
        """Logs ``step`` (a copy of ``grads``); returns whether it was logged.

        A step that is not the next one (a step the donor skipped, e.g. after it was evicted),
        or one past ``max_bytes``, stops the log.
        """
        with self._lock:
            if self.closed_at is not None or self.stopped:
                return False
            head = self.start + len(self._entries)
            n = grads.numel() * grads.element_size()
            if step != head:
                self.stopped = f"step {step} is not the next one ({head})"
            elif self._bytes + n > self.max_bytes:
                self.stopped = f"the log would exceed {self.max_bytes} bytes"
            if self.stopped:
                return False
            self._entries.append((grads.detach().to("cpu", copy=True).contiguous(), hypers))
            self._bytes += n
            return True

    def close(self, at_step: int) -> None:
        """The joiner entered the data plane at ``at_step``: nothing more is logged."""
        with self._lock:
            if self.closed_at is None:
                self.closed_at = at_step

    def answer(self, req: StepLogRequest) -> tuple[StepLogReply | Refusal, list[Any]]:
        """The reply to a joiner's request and its payload frames."""
        with self._lock:
            head = self.start + len(self._entries)
            if req.from_step < self.start or req.from_step > head:
                why = f"the log holds steps [{self.start}, {head}), asked from {req.from_step}"
                return refusal(req.req_id, Reason.OUT_OF_RANGE, why), []
            entries: list[StepEntry] = []
            payload: list[memoryview] = []
            total = 0
            for i in range(req.from_step - self.start, len(self._entries)):
                if len(entries) >= req.max_entries or (entries and total >= MAX_REPLY_BYTES):
                    break
                grads, hypers = self._entries[i]
                raw = grads.view(torch.uint8).numpy().data
                entries.append(StepEntry(step=self.start + i, nbytes=raw.nbytes, hypers=hypers))
                payload.append(raw)
                total += raw.nbytes
            reply = StepLogReply(req_id=req.req_id, start=self.start, head=head,
                                 closed_at=self.closed_at, stopped=bool(self.stopped),
                                 entries=entries)  # fmt: skip
        return reply, payload


def fetch_steps(
    address: str,
    from_step: int,
    like: torch.Tensor,
    timeout_s: float,
    *,
    max_entries: int = 8,
    security: Security | None = None,
) -> tuple[StepLogReply, list[LoggedStep]]:
    """Asks a donor's shard server for its logged steps from ``from_step`` on.

    Args:
        address: The donor's shard server.
        from_step: The first step wanted (the joiner's step).
        like: A gradient buffer as this joiner packs it: each entry must have its dtype and
            size.
        timeout_s: How long to wait for the answer.
        max_entries: Most steps in one answer.
        security: The cluster key (default: none, a plain connection).

    Returns:
        The reply's header and its steps, in order from ``from_step``.

    Raises:
        ChaosTimeout: no answer in time.
        ReplicationError: refused, malformed, or entries of another size.
    """
    from chaos.replication.donor_requests import donor_request  # it imports the state; lazily

    req = StepLogRequest(req_id=2, from_step=from_step, max_entries=max_entries)
    head, frames = donor_request(address, req, timeout_s, security=security, what="step log")
    if not isinstance(head, StepLogReply) or len(frames) != 1 + len(head.entries):
        raise ReplicationError(f"donor {address} answered a step-log request with {head!r}")
    nbytes = like.numel() * like.element_size()
    steps = []
    for i, (entry, raw) in enumerate(zip(head.entries, frames[1:], strict=True)):
        if entry.step != from_step + i or entry.nbytes != nbytes or len(raw) != nbytes:
            raise ReplicationError(
                f"donor {address} logged step {entry.step} with {len(raw)} bytes; expected step "
                f"{from_step + i} with {nbytes}"
            )
        grads = torch.frombuffer(bytearray(raw), dtype=like.dtype)
        steps.append(LoggedStep(entry.step, grads, entry.hypers))
    return head, steps
