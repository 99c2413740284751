"""Raft election rules for choosing the scheduler (no I/O: it returns messages to send).

* Terms only grow; a message from a higher term makes any role a follower of that term.
* One vote per term, first come first served, and only for a candidate whose view epoch is at
  least the voter's (the cluster view plays the part of Raft's log). A former scheduler counts
  the newest epoch it committed too, installed or not: like a Raft leader's log, which holds an
  entry before anyone acknowledges it, it must not help elect a candidate that lacks it.
* A candidate wins with votes from a strict majority of its current membership.
* A member that heard a live scheduler within :attr:`DaemonConfig.scheduler_stickiness_s` denies
  votes (Raft section 6), so a node that was cut off cannot depose a healthy scheduler when it
  comes back; a scheduler handover (``TimeoutNow``) is exempt.
* A handover is honoured only from the scheduler this member follows: a ``TimeoutNow`` from
  anyone else is ignored (:meth:`Election.honours_handover`), and a vote request marked as a
  transfer skips the stickiness rule only once the scheduler it follows has left the view
  (:meth:`Election.honours_transfer`): a leaving scheduler hands over after its own leave is
  committed and acknowledged, so a member that still sees it in the view treats the request as
  any other.
* Election timeouts are randomized in ``election_timeout_range_s``.

A member without a scheduler, or a candidate, is *paused*: it makes no changes. A minority side of
a partition therefore pauses: its candidates never gather a majority.

A new scheduler counts the former scheduler as silent since it was last heard (the election
proved it silent), where a vote request or a vote reply from it counts as hearing it: a former
scheduler that paused (lost its quorum) and then voted or stood is alive, and evicting it would be
a false failure (:func:`carried_silence`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Mapping

from chaos.daemon.config import DaemonConfig
from chaos.daemon.states import Role

from chaos.errors import CounterLimit
from chaos.protocol import MAX_COUNTER, RequestVote, VoteReply


def carried_silence(
    former: tuple[str, float] | None, heard: Mapping[str, float]
) -> tuple[str, float] | None:
    """The former scheduler's silence a new scheduler carries into its failure detector.

    Args:
        former: The former scheduler and when this node last heard it as scheduler, or ``None``.
        heard: When each peer's last vote request or vote reply arrived
            (:attr:`Election.heard`).

    Returns:
        ``None`` without a former scheduler, else it with the later of the two times.
    """
    if former is None:
        return None
    node, contact = former
    return node, max(contact, heard.get(node, float("-inf")))


class Election:
    """One node's election state.

    Args:
        node_id: This node.
        cfg: Timeouts come from here.
        rng: Randomness for the election timeouts (seed it in tests).
    """

    def __init__(self, node_id: str, cfg: DaemonConfig, rng: random.Random | None = None) -> None:
        self.node_id = node_id
        self.cfg = cfg
        self.rng = rng or random.Random()
        self.term = 0
        self.voted_for: str | None = None
        self.role = Role.FOLLOWER
        self.scheduler: str | None = None
        self.last_scheduler_contact = float("-inf")
        self.votes: set[str] = set()
        self.deadline = float("inf")
        self.heard: dict[str, float] = {}
        """When each peer's last vote request or vote reply arrived (proof that it is alive)."""
        self.issued_epoch = 0
        """The newest epoch this node committed as scheduler (see :meth:`issued`)."""

    @property
    def paused(self) -> bool:
        """Whether this node knows no scheduler (and so makes no changes)."""
        return self.role != Role.SCHEDULER and self.scheduler is None

    def reset_deadline(self, now: float) -> None:
        """Arms the randomized election timeout from ``now``."""
        lo, hi = self.cfg.election_timeout_range_s
        self.deadline = now + self.rng.uniform(lo, hi)

    def disarm(self) -> None:
        """Stops the election timer (joining or leaving nodes do not run elections)."""
        self.deadline = float("inf")

    def issued(self, epoch: int) -> None:
        """Records the newest epoch this node committed as scheduler (votes compare with it)."""
        self.issued_epoch = max(self.issued_epoch, epoch)

    def _follow(self, term: int, scheduler: str | None, now: float) -> None:
        """Adopts ``term`` if higher (a new term: no vote cast in it yet) and becomes a
        follower of ``scheduler`` (``None``: none known), with a fresh election timeout."""
        if term > self.term:
            self.term = term
            self.voted_for = None
        self.role = Role.FOLLOWER
        self.scheduler = scheduler
        self.votes.clear()
        self.reset_deadline(now)

    def step_down(self, term: int, now: float) -> None:
        """Becomes a follower without a known scheduler, adopting ``term`` if higher."""
        self._follow(term, None, now)

    def start(self, now: float, epoch: int, transfer: bool = False) -> RequestVote:
        """Starts an election: a new term, a vote for itself.

        Args:
            now: Monotonic time.
            epoch: This node's view epoch (voters with a newer view refuse).
            transfer: A scheduler handover, exempt from the stickiness rule.

        Returns:
            The vote request to send to every other member.

        Raises:
            CounterLimit: The term is at :data:`~chaos.protocol.MAX_COUNTER` (a next one could
                not be encoded).
        """
        if self.term >= MAX_COUNTER:
            raise CounterLimit(f"term {self.term} is at the wire limit: no new election")
        self.term += 1
        self.role = Role.CANDIDATE
        self.voted_for = self.node_id
        self.votes = {self.node_id}
        self.scheduler = None
        self.reset_deadline(now)
        return RequestVote(sender=self.node_id, epoch=epoch, term=self.term, transfer=transfer)

    def honours_handover(self, sender: str) -> bool:
        """Whether a ``TimeoutNow`` from ``sender`` is obeyed: only from the scheduler this
        node follows."""
        return self.scheduler is not None and sender == self.scheduler != self.node_id

    def honours_transfer(self, msg: RequestVote, members: Collection[str]) -> bool:
        """Whether a vote request marked ``transfer`` may skip the stickiness rule.

        Args:
            msg: The request.
            members: This node's membership (its installed view).

        Returns:
            ``True`` when no scheduler is followed (stickiness does not apply anyway), or the
            scheduler it follows is no longer a member (it left and handed over); ``False``
            for a request without ``transfer`` or while the scheduler is still a member.
        """
        if not msg.transfer:
            return False
        if self.role == Role.SCHEDULER:
            return False
        return self.scheduler is None or self.scheduler not in members

    def has_majority(self, members: Collection[str]) -> bool:
        """Whether the votes are a strict majority of ``members``."""
        return 2 * len(self.votes & set(members)) > len(members)

    def on_request_vote(self, msg: RequestVote, now: float, epoch: int) -> VoteReply:
        """Applies the voting rules.

        Args:
            msg: The request (its sender is a member: validation checked).
            now: Monotonic time.
            epoch: This node's view epoch (the newest epoch it committed counts too).

        Returns:
            The reply.
        """
        self.heard[msg.sender] = now
        heard_recently = now - self.last_scheduler_contact < self.cfg.scheduler_stickiness_s
        sticky = self.role == Role.SCHEDULER or (self.scheduler is not None and heard_recently)
        if msg.term < self.term or (sticky and not msg.transfer):
            return VoteReply(sender=self.node_id, epoch=epoch, term=self.term, granted=False)
        if msg.term > self.term:
            armed = self.deadline
            self.step_down(msg.term, now)
            if math.isfinite(armed):
                # a request only restarts the timer if the vote is granted (Raft 5.2): else
                # candidates without the newest epoch, standing in turn with ever higher
                # terms, would keep the only member that can win from ever standing (a soak
                # spent 9-16 s in such elections)
                self.deadline = armed
        newest = max(epoch, self.issued_epoch)
        grant = self.voted_for in (None, msg.sender) and msg.epoch >= newest
        if grant:
            self.voted_for = msg.sender
            self.reset_deadline(now)
        return VoteReply(sender=self.node_id, epoch=epoch, term=self.term, granted=grant)

    def on_vote_reply(self, msg: VoteReply, now: float, members: Collection[str]) -> bool:
        """Counts a vote.

        Returns:
            ``True`` when this vote made the candidate win.
        """
        self.heard[msg.sender] = now
        if msg.term > self.term:
            self.step_down(msg.term, now)
            return False
        if self.role != Role.CANDIDATE or msg.term != self.term or not msg.granted:
            return False
        self.votes.add(msg.sender)
        return self.has_majority(members)

    def become_scheduler(self, now: float) -> None:
        """Takes the scheduler role for the current term."""
        self.role = Role.SCHEDULER
        self.scheduler = self.node_id
        self.last_scheduler_contact = now
        self.disarm()

    def on_scheduler(self, term: int, scheduler: str, now: float) -> bool:
        """Records a scheduler's heartbeat or command (term already checked as not stale).

        Returns:
            ``True`` if the scheduler or term changed.
        """
        changed = term != self.term or scheduler != self.scheduler
        self._follow(term, scheduler, now)
        self.last_scheduler_contact = now
        return changed

    def adopt(self, term: int, scheduler: str | None, now: float) -> None:
        """A (re)joining node takes the cluster's term as its own, even if lower."""
        self.term = term  # even if lower, so _follow adopts nothing more
        self.voted_for = None
        self.issued_epoch = 0  # the view it joins with is newer than anything it committed
        self._follow(term, scheduler, now)
        self.last_scheduler_contact = now
