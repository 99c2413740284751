"""A constant global batch, split across the training members by their speed.

Pure rules, no I/O. Each trainer with ``TrainerConfig.global_batch`` reports its throughput
(samples per second of compute, allreduce waits excluded) in its step progress; its daemon
forwards it to the scheduler (a :class:`~chaos.protocol.TrainerThroughput`).
:class:`BatchSplitter` keeps the latest figures, and the ledger asks it for the split at every
commit, which the sync policy carries (``SyncPolicyWire.batch_sizes``): so every membership
change (join, leave, failure) installs a new split. Between commits, the scheduler re-splits
only when the throughputs drifted so far that the installed split is off by more than the
tolerance (:meth:`BatchSplitter.due`), and not more often than ``min_interval_s``.

:func:`split_batch` is the rule: integer sizes that sum to the global batch exactly, at least
one sample each, each within one sample of its proportional share (the largest-remainder
method), and the previous split kept while it stays within the tolerance of the shares.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

__all__ = ["BatchSplitter", "ideal_shares", "split_batch"]

DEFAULT_TOLERANCE = 0.1
"""How far (relative) a member's installed size may drift from its share before a re-split."""

DEFAULT_MIN_INTERVAL_S = 2.0
"""The shortest time between two re-splits for drift alone (membership changes re-split)."""


def _weights(members: Iterable[str], throughput: Mapping[str, float]) -> dict[str, float]:
    """Each member's weight: its throughput, or, not measured yet (a joiner, or no report),
    the mean of those measured (1 each when none is)."""
    nodes = sorted(set(members))
    known = [throughput[m] for m in nodes if _usable(throughput.get(m))]
    fallback = sum(known) / len(known) if known else 1.0
    return {m: throughput[m] if _usable(throughput.get(m)) else fallback for m in nodes}


def _usable(rate: float | None) -> bool:
    return rate is not None and math.isfinite(rate) and rate > 0.0


def ideal_shares(
    global_batch: int, members: Iterable[str], throughput: Mapping[str, float]
) -> dict[str, float]:
    """Each member's exact share of the global batch, proportional to its throughput.

    Args:
        global_batch: Samples per step over the whole cluster.
        members: The training members.
        throughput: Samples per second per member; a member missing, at 0 or not finite
            weighs as the mean of those measured.

    Returns:
        Member -> fractional share (they sum to ``global_batch``).
    """
    weights = _weights(members, throughput)
    total = sum(weights.values())
    return {m: global_batch * w / total for m, w in weights.items()}


def split_batch(
    global_batch: int,
    members: Iterable[str],
    throughput: Mapping[str, float],
    previous: Mapping[str, int] | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
) -> dict[str, int]:
    """Splits ``global_batch`` across ``members`` in proportion to their throughput.

    The sizes are integers that sum to ``global_batch`` exactly, each at least 1 (so
    ``global_batch`` must be at least the number of members). Each is the floor or the ceiling
    of its proportional share (the largest-remainder method; ties go to the smaller id), but
    where the floor is 0 and the member gets 1. ``previous``, when it covers the same members
    and sums to ``global_batch``, is kept as long as every size stays within one sample plus
    ``tolerance`` (relative) of its share: the rounding, and small throughput noise, change
    nothing.

    Args:
        global_batch: Samples per step over the whole cluster.
        members: The training members (at least one).
        throughput: Samples per second per member (missing, 0 or not finite: the mean of
            those measured).
        previous: The split installed now, if any.
        tolerance: The relative drift from the share that ``previous`` may have.

    Returns:
        Member -> samples per step.

    Raises:
        ValueError: no member, a negative tolerance, or ``global_batch`` below the number of
            members.
    """
    nodes = sorted(set(members))
    if not nodes:
        raise ValueError("split_batch needs at least one member")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int):
        raise ValueError(f"global_batch must be an int, got {global_batch!r}")
    if global_batch < len(nodes):
        raise ValueError(
            f"a global batch of {global_batch} cannot give each of {len(nodes)} members a sample"
        )
    if not tolerance >= 0.0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance!r}")
    shares = ideal_shares(global_batch, nodes, throughput)
    if (
        previous is not None
        and sorted(previous) == nodes
        and sum(previous.values()) == global_batch
        and all(previous[m] >= 1 for m in nodes)
        and all(abs(previous[m] - shares[m]) <= 1.0 + tolerance * shares[m] for m in nodes)
    ):
        return {m: int(previous[m]) for m in nodes}
    sizes = {m: max(1, math.floor(shares[m])) for m in nodes}
    left = global_batch - sum(sizes.values())
    # the members furthest below their share get one more; those furthest above give one back
    while left > 0:
        m = min(nodes, key=lambda n: (sizes[n] - shares[n], n))
        sizes[m] += 1
        left -= 1
    while left < 0:
        m = max((n for n in nodes if sizes[n] > 1), key=lambda n: (sizes[n] - shares[n], n))
        sizes[m] -= 1
        left += 1
    return sizes


class BatchSplitter:
    """The throughputs the trainers report, and the split the scheduler installed.

    Args:
        tolerance: See :func:`split_batch`.
        min_interval_s: The shortest time between two re-splits for drift alone.
    """

    def __init__(
        self,
        tolerance: float = DEFAULT_TOLERANCE,
        min_interval_s: float = DEFAULT_MIN_INTERVAL_S,
    ) -> None:
        self.tolerance = tolerance
        self.min_interval_s = min_interval_s
        self.global_batch = 0
        self.throughput: dict[str, float] = {}
        self.installed: dict[str, int] = {}
        self.installed_at = -math.inf

    def observe(self, node: str, samples_per_s: float, global_batch: int) -> None:
        """Records a trainer's throughput report (``global_batch`` 0: it has none)."""
        if global_batch > 0:
            self.global_batch = global_batch
        if _usable(samples_per_s):
            self.throughput[node] = samples_per_s

    def forget(self, node: str) -> None:
        """Drops a node that left or failed (its next trainer measures again)."""
        self.throughput.pop(node, None)

    def _split(self, members: Iterable[str]) -> dict[str, int]:
        nodes = sorted(set(members))
        if self.global_batch <= 0 or not nodes or self.global_batch < len(nodes):
            return {}
        return split_batch(
            self.global_batch, nodes, self.throughput, self.installed, self.tolerance
        )

    def sizes(self, members: Iterable[str], now: float) -> dict[str, int]:
        """The split a commit installs for ``members`` (recorded as installed).

        Returns:
            Member -> samples per step; empty when no global batch is known, or it is smaller
            than the number of members (the trainers then split it evenly themselves).
        """
        split = self._split(members)
        if split != self.installed:
            self.installed_at = now
        self.installed = split
        for node in set(self.throughput) - set(split):
            if split:
                self.throughput.pop(node)
        return split

    def due(self, members: Iterable[str], now: float) -> bool:
        """Whether a re-split should be committed now: the throughputs drifted beyond the
        tolerance (or a global batch became known), and ``min_interval_s`` has passed since the
        split last changed."""
        if now - self.installed_at < self.min_interval_s:
            return False
        return self._split(members) != self.installed
