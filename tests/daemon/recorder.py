"""A daemon's context without its sockets, for testing a flow's rules in process.

:func:`recording_context` builds a real :class:`chaos.daemon.context.Context` (real facts, a real
election, real timers and metrics without a server) whose outbox and event log are a
:class:`Recorder`: it records what the flow sends, answers, broadcasts and logs, so a test can
check it; the transport is not under test here.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

from chaos.daemon.config import DaemonConfig
from chaos.daemon.context import Context, NodeFacts
from chaos.daemon.election import Election
from chaos.daemon.metrics import Metrics
from chaos.daemon.states import DaemonState
from chaos.daemon.timers import Timers
from chaos.daemon.vote_certs import VoteBook

from chaos.protocol import Message


class Recorder:
    """The outbox and the event log of a context, recording.

    Attributes:
        answers: The replies given (``respond``), in order; ``answered_to`` their reply paths.
        events: The events logged, as ``(name, fields)``.
        updates: The messages broadcast to the members (the committed epochs).
        sent: The messages sent to one peer, as ``(peer, message)``; ``attachments`` theirs.
        to_sched: The messages sent to the scheduler.
        has_scheduler: What ``to_scheduler`` answers (whether a scheduler is known).
    """

    def __init__(self, has_scheduler: bool = True) -> None:
        self.answers: list[Any] = []
        self.answered_to: list[Any] = []
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.updates: list[Any] = []
        self.sent: list[tuple[str, Any]] = []
        self.attachments: list[bytes | None] = []
        self.sent_to_address: list[Any] = []
        self.to_sched: list[Message] = []
        self.has_scheduler = has_scheduler
        self.local: deque[Message] = deque()

    # -- the outbox ------------------------------------------------------------------------

    def send(self, peer: str, msg: Any, attachment: bytes | None = None) -> bool:
        self.sent.append((peer, msg))
        self.attachments.append(attachment)
        return True

    def respond(self, reply: Any, msg: Any) -> None:
        self.answers.append(msg)
        self.answered_to.append(reply)

    def send_to_address(self, peer: str, address: str, msg: Any) -> None:
        self.sent_to_address.append(msg)

    def connect_peer(self, peer: str, address: str) -> bool:
        return True  # a connection that is already up: every ping goes out at once

    def peer_address(self, peer: str) -> str | None:
        return None  # never re-pointed here

    def broadcast(self, peers: dict[str, str], msg: Any) -> None:
        self.updates.append(msg)

    def to_scheduler(self, msg: Any) -> bool:
        self.to_sched.append(msg)
        return self.has_scheduler

    # -- the event log ---------------------------------------------------------------------

    def emit(self, name: str, **fields: Any) -> None:
        self.events.append((name, fields))

    def recent(self) -> list[Any]:
        return []

    def close(self) -> None:
        pass

    def named(self, name: str) -> list[dict[str, Any]]:
        """The fields of every event called ``name``, in order."""
        return [f for n, f in self.events if n == name]


def recording_context(
    cfg: DaemonConfig | None = None,
    recorder: Recorder | None = None,
    state: DaemonState = DaemonState.ACTIVE,
    term: int = 1,
    incarnation: str = "incarnation1",
) -> tuple[Context, Recorder]:
    """A context for node ``cfg.node_id`` (default ``a``) in ``state`` and ``term``, recording.

    Returns:
        The context and its recorder.
    """
    cfg = cfg or DaemonConfig(node_id="a", listen="tcp://127.0.0.1:1")
    rec = recorder or Recorder()
    election = Election(cfg.node_id, cfg, random.Random(1))
    election.term = term
    facts = NodeFacts(cfg, election, VoteBook(cfg.node_id, None), incarnation=incarnation)
    facts.state = state
    metrics = Metrics(cfg.node_id, None)
    ctx = Context(facts, rec, rec, Timers(), metrics)  # type: ignore[arg-type]
    return ctx, rec
