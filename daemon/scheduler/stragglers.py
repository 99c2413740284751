"""Stragglers: a trainer that holds up every other trainer's step, found from step progress.

Pure rules, no I/O: the scheduler role feeds :class:`StragglerWatch` the progress reports and
acts on its answers (see :mod:`chaos.daemon.scheduler.role`).

Every trainer tells its local daemon where it is in its steps (a
:class:`~chaos.protocol.TrainerProgress`: its step, whether it is inside ``update()``, how long
it has been in that phase), and keeps doing so while it waits inside an allreduce. Its daemon
forwards the latest report to the scheduler once per heartbeat interval, with how long the
trainer has been *silent* (not heard). A trainer that computes its gradients, or whose process
is stopped, is silent; one that waits for the others is not. The daemon is a separate process,
so a stopped trainer behind a live daemon is invisible to the failure detector; this is what
finds it.

**The rule.** A training member ``S`` is a straggler when another training member ``W`` has
been waiting inside ``update()`` at step ``N`` for longer than the grace period, ``S`` has been
silent for longer than the grace period, and ``S`` has not completed step ``N`` (its step is at
most ``N``). A device that is merely slow is heard at every step it completes, so with a grace
above its step time it is never silent that long: it sets the pace. Members that all wait (a
link that drops its packets) are all heard: nobody is a straggler.

**A slow step is not a straggler.** When the step is slow for everyone (a slow link: every
member spends seconds moving the allreduce's bytes), a member may go unheard for a while without
holding anyone up. So the grace scales with the step period the members measured: the rule
applies :meth:`StragglerWatch.grace_at`, the larger of ``grace_s`` and :data:`PERIOD_FACTOR`
times the cluster's step period. A member's step period is the shortest of its last
:data:`PERIOD_SAMPLES` intervals between step advances (one long step, a join's barrier say,
does not stretch it); the cluster's is the median over the training members. A member that
stops does not lengthen anything: its period, and the waiters', were measured before it stopped.

**A step behind.** A member that is heard and waits inside ``update()`` at step ``N`` while
other members wait at a later step, all of them past the step-behind grace period (shorter
than the straggler's: members waiting at two different steps is never a normal state), missed
the result of a round the others completed (the last frames to it were lost as the round
ended). It can only take that result from a neighbour that kept it, which takes milliseconds;
when it has not in a whole grace period, the
round can never complete: the others wait for its step ``N + 1`` and it waits for their step
``N``, and every restart fails again. It is evicted like a straggler and joins again, pulling
the state the others reached (never the other way round: the step they completed stays).

**Blame.** When a trainer's allreduce fails after waiting ``waited_s`` (``step_timeout_s``),
the peer it names is the neighbour that stopped sending, which in a tree or ring is often not
the member that stopped. :meth:`StragglerWatch.blame` names instead the member silent the
longest, provided it has been silent for at least half of ``min(grace, waited_s)``.

A report counts only while it is fresh (``fresh_s``, a few heartbeat intervals): a daemon that
stopped reporting (its trainer's registration ended, or the daemon itself is silent, which is
the failure detector's business) says nothing about its trainer.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

__all__ = ["PERIOD_FACTOR", "PERIOD_SAMPLES", "Progress", "Straggler", "StragglerWatch"]

PERIOD_FACTOR = 2.0
"""The grace is at least this many step periods (see the module's rule)."""
PERIOD_SAMPLES = 3
"""A member's step period is the shortest of this many of its last step intervals."""


@dataclass(frozen=True)
class Progress:
    """One member's latest progress report, as the scheduler received it.

    Attributes:
        step: The trainer's step (optimizer steps taken; the step it computes or reduces).
        in_step: The trainer was inside ``update()`` (waiting for the allreduce).
        phase_s: How long it had been in that phase when the report was sent.
        silent_s: How long its daemon had not heard from it when the report was sent.
        received: When the scheduler received the report (monotonic seconds).
    """

    step: int
    in_step: bool
    phase_s: float
    silent_s: float
    received: float

    def silent_at(self, now: float) -> float:
        """How long the trainer has been silent at ``now`` (the report aged)."""
        return self.silent_s + max(0.0, now - self.received)

    def phase_at(self, now: float) -> float:
        """How long the trainer has been in its phase at ``now`` (the report aged)."""
        return self.phase_s + max(0.0, now - self.received)


@dataclass(frozen=True)
class Straggler:
    """A member found holding up the others.

    Attributes:
        node: The straggler.
        step: Its last reported step.
        silent_s: How long it has been silent.
        at_step: The step the others wait at.
        waiting: The members waiting for it, sorted.
        waited_s: The longest of their waits.
        behind: Found by the "a step behind" rule (heard, but stuck in an older step than
            the others), not by its silence.
    """

    node: str
    step: int
    silent_s: float
    at_step: int
    waiting: tuple[str, ...]
    waited_s: float
    behind: bool = False


class StragglerWatch:
    """The members' step progress, and who holds the others up.

    Args:
        grace_s: The grace period (``straggler_grace_s``); 0 turns the rule off (:meth:`find`
            then finds nobody; :meth:`blame` still names a silent member).
        fresh_s: How long a report counts after it was received.
        behind_grace_s: The grace period of the step-behind rule (``behind_grace_s``); 0
            turns that rule off. Default: ``grace_s``.
    """

    def __init__(self, grace_s: float, fresh_s: float, behind_grace_s: float | None = None
                 ) -> None:  # fmt: skip
        self.grace_s = grace_s
        self.behind_grace_s = grace_s if behind_grace_s is None else behind_grace_s
        self.fresh_s = fresh_s
        self.reports: dict[str, Progress] = {}
        self._advanced: dict[str, tuple[int, float]] = {}  # the last step seen, and when
        self._intervals: dict[str, deque[float]] = {}  # seconds per step, the last few

    def report(
        self, node: str, step: int, in_step: bool, phase_s: float, silent_s: float, now: float
    ) -> None:
        """Records ``node``'s progress report, received at ``now``."""
        self.reports[node] = Progress(step, in_step, phase_s, silent_s, now)
        last = self._advanced.get(node)
        if last is None or step < last[0]:
            self._advanced[node] = (step, now)  # first seen, or a rejoined trainer's new steps
        elif step > last[0]:
            per = (now - last[1]) / (step - last[0])
            self._intervals.setdefault(node, deque(maxlen=PERIOD_SAMPLES)).append(per)
            self._advanced[node] = (step, now)

    def forget(self, node: str) -> None:
        """Drops what is known of ``node``'s trainer (it was evicted, left or failed)."""
        self.reports.pop(node, None)
        self._advanced.pop(node, None)
        self._intervals.pop(node, None)

    def step_period(self, training: Collection[str]) -> float | None:
        """The cluster's step period (seconds): the median over ``training`` of each member's
        shortest recent step interval; ``None`` while no member's is measured."""
        periods = [min(q) for n, q in self._intervals.items() if n in training and q]
        return statistics.median(periods) if periods else None

    def grace_at(self, training: Collection[str]) -> float:
        """The grace the straggler rule applies: ``grace_s``, or :data:`PERIOD_FACTOR` step
        periods when that is longer (0 when the rule is off)."""
        if self.grace_s <= 0:
            return 0.0
        period = self.step_period(training)
        return max(self.grace_s, PERIOD_FACTOR * period) if period is not None else self.grace_s

    def _fresh(self, training: Collection[str], now: float) -> dict[str, Progress]:
        return {
            n: p
            for n, p in self.reports.items()
            if n in training and now - p.received <= self.fresh_s
        }

    def find(self, training: Collection[str], now: float) -> list[Straggler]:
        """The stragglers among ``training`` at ``now`` (see the module's rule).

        Args:
            training: The members whose trainer is training (a syncing joiner, still pulling
                its state, is neither a straggler nor a waiter).
            now: Monotonic time.

        Returns:
            The stragglers, sorted by id (empty when the grace is 0).
        """
        grace = self.grace_at(training)
        if grace <= 0:
            return []
        fresh = self._fresh(training, now)
        alive_s = self.grace_s / 2  # a waiting trainer is heard far more often than this
        waiters = {
            n: p
            for n, p in fresh.items()
            if p.in_step and p.silent_at(now) < alive_s and p.phase_at(now) > grace
        }
        if not waiters:
            return []
        found = []
        for n, p in sorted(fresh.items()):
            if n in waiters or p.silent_at(now) <= grace:
                continue
            held = {w: q for w, q in waiters.items() if p.step <= q.step}
            if not held:
                continue
            at_step = max(q.step for q in held.values())
            found.append(
                Straggler(
                    node=n,
                    step=p.step,
                    silent_s=p.silent_at(now),
                    at_step=at_step,
                    waiting=tuple(sorted(held)),
                    waited_s=max(q.phase_at(now) for q in held.values()),
                )
            )
        return found

    def behind(self, training: Collection[str], now: float) -> list[Straggler]:
        """The members stuck a step behind the others (see the module's second rule).

        Args:
            training: The members whose trainer is training.
            now: Monotonic time.

        Returns:
            Each member waiting inside ``update()`` at an older step than the newest step
            other members wait at, every one of them heard and waiting past the step-behind
            grace period, sorted by id (empty when that grace is 0).
        """
        grace = self.behind_grace_s
        if grace <= 0:
            return []
        stuck = {
            n: p
            for n, p in self._fresh(training, now).items()
            if p.in_step and p.silent_at(now) < grace / 2 and p.phase_at(now) > grace
        }
        if not stuck:
            return []
        top = max(p.step for p in stuck.values())
        ahead = {n: p for n, p in stuck.items() if p.step == top}
        waited = max(p.phase_at(now) for p in ahead.values())
        return [
            Straggler(node=n, step=p.step, silent_s=p.silent_at(now), at_step=top,
                      waiting=tuple(sorted(ahead)), waited_s=waited, behind=True)
            for n, p in sorted(stuck.items())
            if p.step < top
        ]  # fmt: skip

    def blame(
        self,
        reporter: str,
        neighbour: str,
        waited_s: float,
        training: Collection[str],
        now: float,
    ) -> str:
        """The member to blame for ``reporter``'s failed allreduce.

        Args:
            reporter: The trainer whose round failed.
            neighbour: The peer its round named (the neighbour that stopped sending).
            waited_s: How long its round waited before it failed (0: not said).
            training: The members whose trainer is training.
            now: Monotonic time.

        Returns:
            The member silent the longest, if it has been silent for at least half of
            ``min(grace, waited_s)`` (the grace alone when the wait is not known, or when the
            rule is off), else ``neighbour``.
        """
        limits = [x for x in (self.grace_s, waited_s) if x > 0]
        if not limits:
            return neighbour
        least = min(limits) / 2
        fresh = self._fresh(training, now)
        silent = [(p.silent_at(now), n) for n, p in fresh.items() if n != reporter]
        silent = [(s, n) for s, n in silent if s >= least]
        return max(silent)[1] if silent else neighbour
