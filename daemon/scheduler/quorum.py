"""The scheduler's quorum base: Raft's single-server membership changes (pure rules, no I/O).

Each committed epoch carries a membership (its view's nodes). The rules, as Raft's single-server
changes state them with the view in place of the log's configuration entry:

* The **quorum base** is the membership of the newest epoch the scheduler committed, in force
  from the moment it is committed, before any member acknowledged it (Raft: a server uses the
  newest configuration in its log, committed or not). A member that left gracefully, or that was
  removed as failed, stops counting as soon as the epoch without it is committed.
* An epoch is **settled** once a strict majority of its own membership acknowledged it (Raft:
  the configuration entry is committed by a majority of the new configuration).
* While an epoch is unsettled, no member is removed as failed: memberships change one member at
  a time, each settled before the next, so a majority of one membership and a majority of the
  next always share a member, and two schedulers can never each gather a majority.

The earlier rule also required a majority of the *previous* membership before settling. That is
joint consensus's rule, needed only when a change swaps several members at once; for a single
removal it is stronger than needed, and wrong when the removed member is a leaver, which never
acknowledges again: a leave and a crash in one detection window left a base that no set of live
members could reach.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping


def is_majority(voters: Collection[str], members: Collection[str]) -> bool:
    """Whether ``voters`` include a strict majority of ``members``."""
    group = set(members)
    return 2 * len(group & set(voters)) > len(group)


def majority_acked(members: Collection[str], acked: Mapping[str, int], epoch: int) -> bool:
    """Whether a strict majority of ``members`` acknowledged ``epoch`` (or a later one)."""
    return is_majority([m for m in members if acked.get(m, 0) >= epoch], members)


class QuorumBase:
    """The membership in force and the epochs not yet settled.

    Args:
        members: The membership of the last epoch (a new scheduler's installed view).
    """

    def __init__(self, members: Iterable[str]) -> None:
        self.members: frozenset[str] = frozenset(members)
        self.unsettled: dict[int, frozenset[str]] = {}

    def committed(self, epoch: int, members: Iterable[str]) -> None:
        """Records a committed epoch: its membership is the quorum base from now on."""
        self.members = frozenset(members)
        self.unsettled[epoch] = self.members

    def settle(self, acked: Mapping[str, int]) -> list[int]:
        """Settles, oldest first, the epochs a majority of their own membership acknowledged.

        Args:
            acked: The newest epoch each member acknowledged.

        Returns:
            The epochs settled now.
        """
        done: list[int] = []
        for epoch in sorted(self.unsettled):
            if not majority_acked(self.unsettled[epoch], acked, epoch):
                break
            del self.unsettled[epoch]
            done.append(epoch)
        return done

    @property
    def settling(self) -> bool:
        """Whether a committed epoch still waits for a majority of its membership."""
        return bool(self.unsettled)
