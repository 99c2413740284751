"""The answers to what this node sent: an :class:`~chaos.protocol.OpResult` or a
:class:`~chaos.protocol.Refusal` from a peer.

An answer may concern several flows at once, so :class:`Answers` hands it to each that may be
waiting for it, in order: this node's own leave, the local trainer's relayed messages, the
local clients' relayed requests; a refusal may also say that this node's term is stale (it
steps down) or that the cluster moved on without it (it joins again).
"""

from __future__ import annotations

from chaos.daemon.dispatch import Handler
from chaos.daemon.membership import Membership
from chaos.daemon.relay import TrainerRelay
from chaos.daemon.relayed import RelayedOps
from chaos.daemon.scheduler.role import DaemonContext
from chaos.daemon.states import DaemonState
from chaos.daemon.succession import Succession
from chaos.daemon.transport import ReplyPath

from chaos.protocol import OpResult, Refusal


class Answers:
    """Hands each answer to the flows waiting for it.

    Args:
        ctx: The daemon's context.
        relayed: The local clients' requests relayed to the scheduler.
        trainer: The local trainer's relayed messages.
        membership: This node's own join and leave.
        succession: Steps down when a peer names a newer term.
    """

    def __init__(
        self,
        ctx: DaemonContext,
        relayed: RelayedOps,
        trainer: TrainerRelay,
        membership: Membership,
        succession: Succession,
    ) -> None:
        self.ctx = ctx
        self.relayed = relayed
        self.trainer = trainer
        self.membership = membership
        self.succession = succession

    def handlers(self) -> dict[type, Handler]:
        """The answers: results and refusals."""
        return {OpResult: self.on_op_result, Refusal: self.on_refusal}

    def on_op_result(self, msg: OpResult, reply: ReplyPath | None, now: float) -> None:
        """A result: this node's leave's, else the trainer's and a client's."""
        if self.membership.on_leave_result(msg):
            return
        self.trainer.on_result(msg)
        self.relayed.on_result(msg)

    def on_refusal(self, msg: Refusal, reply: ReplyPath | None, now: float) -> None:
        """A refusal: recorded, passed to whoever waits for the answer, and acted on when it
        names a newer term or says the cluster no longer knows this node."""
        f = self.ctx.facts
        self.ctx.event("refused_by_peer", peer=msg.sender, reason=msg.reason,
                       ref_type=msg.ref_type, detail=msg.detail)  # fmt: skip
        op_id = self.trainer.on_refusal(msg)
        if op_id:
            self.relayed.refused(op_id, msg.reason, msg.detail or "refused by the scheduler")
        if msg.reason == "stale_term" and msg.term > f.term and msg.sender in f.members():
            # only a member's (its id is bound to its key): a stranger's forged refusal with a
            # higher term would depose the scheduler, over and over
            self.succession.on_stale_term(msg.term, now)
            return
        if self.membership.on_refusal(msg):
            return
        if (
            msg.reason == "unknown_peer"
            and msg.ref_type == "request_vote"
            and f.state == DaemonState.ACTIVE
            and f.paused
        ):
            self.membership.rejoin(None, msg.sender, now)  # the cluster moved on without us
