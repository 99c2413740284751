"""Repeat offenders: a device whose gradients keep making the members' steps non-finite.

Pure rules, no I/O: the scheduler role feeds :class:`OffenderWatch` the trainers' reports and
acts on its answers (see :mod:`chaos.daemon.scheduler.role`).

With ``TrainerConfig.nonfinite = "skip"``, every member skips a step whose summed gradients are
not finite, alike, and names the devices whose contribution was marked bad
(:mod:`chaos.trainer.finite`). Each member tells its daemon (a
:class:`~chaos.protocol.NonfiniteStep`: the step and the devices), and the daemon forwards it
to the scheduler at once. A device that spoils one step (an fp16 overflow, one corrupt batch)
costs the cluster that step; one that spoils every step (a broken accelerator, a corrupt local
shard) stops the cluster learning, so it must leave the sync policy.

**The rule.** A device ``D`` *offends* at step ``s`` when a strict majority of the members
training when the report comes named ``D`` in their report of step ``s``. Every member holds
the same sum, so honest members name the same devices: a majority is reached at once, and one
member's report alone (a forged or confused one) never counts. Reports are deduplicated per
step and reporter: a step counts once however many members report it. ``D`` is *due* for
eviction once it offended in ``limit`` steps within the last ``window`` steps (up to the newest
step reported). The scheduler evicts it like a straggler (the node stays a member without a
trainer; its trainer joins again, pulling the state the others hold), and :meth:`forget` starts
its count afresh. A device is never due while it is the only training member: there would be
nobody left to train, nor to pull a state from.

The reports kept are bounded: a step older than ``window`` steps before the newest step
reported is dropped, with its reporters.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

__all__ = ["Offender", "OffenderWatch"]


@dataclass(frozen=True)
class Offender:
    """A device due for eviction.

    Attributes:
        node: The device.
        steps: The steps it offended in, within the window, ascending.
        limit: The rule's limit (``len(steps)`` is at least this).
        window: The rule's window, in steps.
    """

    node: str
    steps: tuple[int, ...]
    limit: int
    window: int

    @property
    def count(self) -> int:
        """How many offences the window holds."""
        return len(self.steps)


class OffenderWatch:
    """The members' reports of skipped non-finite steps, and who offends too often.

    Args:
        limit: Offences within the window that make a device due (``offender_limit``); 0 turns
            the rule off (:meth:`due` then finds nobody; reports are still counted).
        window: The window, in steps (``offender_window_steps``, at least 1).

    Raises:
        ValueError: a negative limit, or a window below 1.
    """

    def __init__(self, limit: int, window: int) -> None:
        if limit < 0 or window < 1:
            raise ValueError(f"offender limit {limit} must be >= 0 and window {window} >= 1")
        self.limit = limit
        self.window = window
        self._named: dict[int, dict[str, set[str]]] = {}  # step -> device -> its reporters
        self.offences: dict[str, list[int]] = {}  # device -> the steps it offended in
        self._newest = 0

    def report(
        self, reporter: str, step: int, devices: Iterable[str], training: Collection[str]
    ) -> list[str]:
        """Records ``reporter``'s report that step ``step`` was skipped, naming ``devices``.

        Args:
            reporter: The member whose trainer reported it (counted once per step).
            step: The step skipped.
            devices: The devices its trainer named.
            training: The members training now (a reporter or device outside it is ignored).

        Returns:
            The devices whose offence at ``step`` this report made count (a majority named them
            now), sorted.
        """
        if reporter not in training:
            return []
        if step + self.window <= self._newest:
            return []  # older than anything kept: its offence, if any, is out of the window
        self._newest = max(self._newest, step)
        self._prune()
        named = self._named.setdefault(step, {})
        counted = []
        majority = len(training) // 2 + 1
        for dev in sorted(set(devices)):
            if dev not in training:
                continue
            reporters = named.setdefault(dev, set())
            if reporter in reporters:
                continue
            reporters.add(reporter)
            steps = self.offences.setdefault(dev, [])
            if len(reporters & set(training)) >= majority and step not in steps:
                steps.append(step)  # counts once, however many more report it
                counted.append(dev)
        return counted

    def _prune(self) -> None:
        """Drops the reports and the offences of steps out of the window."""
        oldest = self._newest - self.window
        for step in [s for s in self._named if s <= oldest]:
            del self._named[step]
        for node in list(self.offences):
            kept = [s for s in self.offences[node] if s > oldest]
            if kept:
                self.offences[node] = kept
            else:
                del self.offences[node]

    def in_window(self, node: str) -> tuple[int, ...]:
        """The steps ``node`` offended in within the window (the last ``window`` steps up to
        the newest step reported), ascending."""
        return tuple(sorted(self.offences.get(node, ())))

    def due(self, training: Collection[str]) -> list[Offender]:
        """The training devices due for eviction (see the module's rule), sorted by id; none
        when the limit is 0 or fewer than two members train."""
        if self.limit <= 0 or len(training) < 2:
            return []
        found = []
        for node in sorted(self.offences):
            steps = self.in_window(node)
            if node in training and len(steps) >= self.limit:
                found.append(Offender(node, steps, self.limit, self.window))
        return found

    def forget(self, node: str) -> None:
        """Drops ``node``'s offences and the reports naming it (it was evicted, left or
        failed): a trainer that joins again starts afresh."""
        self.offences.pop(node, None)
        for named in self._named.values():
            named.pop(node, None)
