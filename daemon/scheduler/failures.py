"""Failure detection on the scheduler: when each member was last heard, and who is failed.

A member silent for ``failure_timeout_s`` is failed. If the members still heard are not a strict
majority of the quorum base (the membership of the newest committed epoch, see
:mod:`chaos.daemon.scheduler.quorum`), nothing is removed: the scheduler has lost its quorum, steps
down and pauses. Otherwise one member is removed per commit while an earlier membership change
is still unacknowledged (Raft's single-server change).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from chaos.daemon.config import DaemonConfig
from chaos.daemon.scheduler.quorum import is_majority


@dataclass
class Verdict:
    """What a failure check found.

    Attributes:
        failed: The members to remove now (empty: none, or the quorum is lost).
        silent_s: How long each member has been silent.
        quorum_lost: The members still heard are not a majority of the quorum base.
        overdue: Every member silent past the timeout (``failed`` may hold fewer).
    """

    failed: list[str] = field(default_factory=list)
    silent_s: dict[str, float] = field(default_factory=dict)
    quorum_lost: bool = False
    overdue: list[str] = field(default_factory=list)


class FailureDetector:
    """When each member was last heard, and which of them failed.

    Args:
        node_id: The scheduler itself (always heard: it is the one checking).
        cfg: ``failure_timeout_s``.
        members: The members, heard for the first time at ``now``.
        now: Monotonic time.
    """

    def __init__(self, node_id: str, cfg: DaemonConfig, members: Iterable[str], now: float) -> None:
        self.node_id = node_id
        self.cfg = cfg
        self.last_heard: dict[str, float] = {m: now for m in members}

    def heard(self, node: str, now: float) -> None:
        """Records that ``node`` was heard at ``now``."""
        self.last_heard[node] = now

    def forget(self, node: str) -> None:
        """Stops watching a node that left or failed."""
        self.last_heard.pop(node, None)

    def fresh(self, node: str, now: float) -> bool:
        """Whether ``node`` was heard within ``failure_timeout_s``."""
        return now - self.last_heard.get(node, float("-inf")) < self.cfg.failure_timeout_s

    def next_deadline(self) -> float:
        """When the next member would time out (for the loop's timer)."""
        others = [t for m, t in self.last_heard.items() if m != self.node_id]
        return (min(others) if others else float("inf")) + self.cfg.failure_timeout_s

    def check(
        self, members: list[str], base: Collection[str], single_change: bool, now: float
    ) -> Verdict:
        """Judges the members' silences.

        Args:
            members: The current membership.
            base: The quorum base (the membership of the newest committed epoch).
            single_change: Remove at most one member (the longest silent): a membership
                change committed earlier is still settling.
            now: Monotonic time.

        Returns:
            The verdict.
        """
        self.last_heard[self.node_id] = now
        silent = {m: now - self.last_heard.get(m, now) for m in members}
        overdue = [m for m, s in silent.items() if s > self.cfg.failure_timeout_s]
        verdict = Verdict(silent_s=silent, overdue=overdue)
        if not overdue:
            return verdict
        heard = [m for m in base if m not in overdue and (m in silent or m == self.node_id)]
        if not is_majority(heard, base):
            verdict.quorum_lost = True
            return verdict
        # Raft's single-server change: remove one member per commit (the longest silent); the
        # next goes once a majority of the old and the new membership acknowledged it. Removing
        # several at once lets a minority's new membership be its own majority: a side of a
        # partition that still heard one member of the other side for a moment would commit a
        # view that its own election could win.
        verdict.failed = [max(overdue, key=lambda m: (silent[m], m))] if single_change else overdue
        return verdict
