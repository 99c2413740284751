"""A newly elected scheduler's rebuild of the cluster view from its members' reports.

After an election the new scheduler starts from the last view it installed. Every member sends
an :class:`~chaos.protocol.AgentReport` (its resources, its measured links, its trainer's
registration); the rebuild ends, with one commit, when every member reported or
``failure_timeout_s`` passed. A bootstrap (a new one-node cluster) has nothing to wait for.
"""

from __future__ import annotations

from typing import Protocol

from chaos.daemon.scheduler.ledger import EpochLedger
from chaos.daemon.scheduler.monitor import ClusterMonitor

from chaos.protocol import MAX_EPOCH_JUMP, AgentReport


class TrainerRecords(Protocol):
    """The trainer registrations the reports rebuild."""

    def absorb(self, node: str, fields: dict[str, object]) -> bool: ...  # noqa: D102

    def replan_syncing(self) -> None: ...  # noqa: D102


class ViewRebuild:
    """Waits for the members' reports after an election, then commits the rebuilt view.

    Args:
        monitor: The cluster monitor the reports fill in.
        ledger: The epochs (the rebuild is over once an update was committed).
        trainers: The trainer registrations.
        waiting: The members whose reports are awaited (empty: a bootstrap).
        deadline: When the rebuild is committed without the missing reports.
    """

    def __init__(
        self,
        monitor: ClusterMonitor,
        ledger: EpochLedger,
        trainers: TrainerRecords,
        waiting: set[str],
        deadline: float,
    ) -> None:
        self.monitor = monitor
        self.ledger = ledger
        self.trainers = trainers
        self.waiting = waiting
        self.deadline = deadline
        self.removed = False
        """Whether a member failed during the rebuild (the commit then restarts the allreduce:
        the trainers' round in flight still waits on it)."""

    def on_report(self, msg: AgentReport, now: float) -> None:
        """Takes an agent's report into the monitor; commits when it was the last awaited, or
        when it came after the rebuild and changed a trainer (its policy must say so)."""
        ledger, mon = self.ledger, self.monitor
        late = ledger.last_update is not None  # the rebuild was committed without this report
        if not late and mon.has(msg.sender) and msg.epoch <= ledger.epoch + MAX_EPOCH_JUMP:
            # a member may hold a commit of the former scheduler this one never saw: the
            # rebuild's commit must be newer, or that member would refuse it as stale. Only a
            # member's report, before the rebuild's commit, and never far ahead (validation
            # refuses those already): an epoch otherwise only grows by a commit
            ledger.epoch = max(ledger.epoch, msg.epoch)
        changed = False
        if mon.has(msg.sender):
            mon.set_resources(msg.sender, msg.resources)
            for link in msg.links:
                if mon.has(link.a) and mon.has(link.b):
                    mon.set_link(
                        link.a,
                        link.b,
                        up=link.up,
                        latency_s=link.latency_s,
                        bandwidth_bps=link.bandwidth_bps,
                    )
            changed = self.trainers.absorb(
                msg.sender,
                {
                    "trainer": msg.trainer,
                    "data_address": msg.data_address,
                    "shard_address": msg.shard_address,
                    "tensor_sizes": msg.tensor_sizes,
                },
            )
        self.waiting.discard(msg.sender)
        self.maybe_finish(now)
        if late and changed:  # e.g. a trainer that became ready: its policy must say so
            ledger.commit("trainer_report", now)

    def forget(self, node: str) -> None:
        """Stops waiting for a member that failed (the rebuilt view leaves it out)."""
        self.waiting.discard(node)
        self.removed = True

    def maybe_finish(self, now: float) -> None:
        """Commits the rebuilt view once every report came or the deadline passed."""
        if self.ledger.last_update is not None:
            return
        if self.waiting and now < self.deadline:
            return
        self.waiting.clear()
        self.trainers.replan_syncing()
        cause = "reelection" if self.ledger.epoch > 0 else "bootstrap"
        if self.removed:
            # like a scale-in: the round in flight waits on the failed member (often the former
            # scheduler) and would otherwise run to its step timeout or a dropped connection
            self.ledger.commit(cause, now, apply_at="before_next_allreduce", restart=True)
        else:
            self.ledger.commit(cause, now)
