"""The time model of multi-neighbour state replication (paper section III, eq. 1, plus c).

A neighbour ``u`` that sends ``n_u`` shards holding ``bytes_u`` bytes in total finishes at::

    t_u = prop_u + sync_u + bytes_u * trans_u + n_u * c        (n_u > 0)
    t_u = 0                                                    (n_u = 0: u sends nothing)

where ``prop_u`` is the propagation delay, ``sync_u`` (the paper's tau_u^sync) is when ``u``
finishes its current allreduce, ``trans_u`` is seconds per byte, and ``c`` is a fixed per-shard cost
(message overhead). With equal shards of ``s`` bytes this is the paper's eq. (1) plus ``n_u * c``.
The plan's makespan (the paper's theta) is the largest ``t_u``.

Every duration is in seconds (``float``); sizes are in bytes (``int``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

Assignment = Mapping[str, Sequence[tuple[int, int]]]
"""Neighbour id -> list of ``(offset, length)`` byte ranges of the flat state stream."""


def _check_duration(name: str, value: float, *, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")


@dataclass(frozen=True)
class Neighbor:
    """One overlay neighbour of the joining node, with its measured link parameters.

    Args:
        id: Unique node id of the neighbour.
        prop_s: Propagation delay of the link to the joiner, in seconds.
        trans_s_per_byte: Transmission time per byte, in seconds (``8 / bandwidth_bps``).
            Must be > 0: a neighbour without bandwidth cannot send.
        sync_s: When this neighbour finishes its current allreduce and can start sending
            (the paper's tau_u^sync), in seconds from now.

    Raises:
        ValueError: a value is negative, non-finite, or the id is empty.
        TypeError: a value has the wrong type.
    """

    id: str
    prop_s: float
    trans_s_per_byte: float
    sync_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise ValueError(f"neighbour id must be a non-empty string, got {self.id!r}")
        _check_duration(f"neighbour {self.id!r} prop_s", self.prop_s)
        _check_duration(
            f"neighbour {self.id!r} trans_s_per_byte (non-positive bandwidth?)",
            self.trans_s_per_byte,
            positive=True,
        )
        _check_duration(f"neighbour {self.id!r} sync_s", self.sync_s)

    @classmethod
    def from_bandwidth(
        cls, id: str, bandwidth_bps: float, prop_s: float, sync_s: float = 0.0
    ) -> Neighbor:
        """Builds a neighbour from a link bandwidth in bits per second.

        Raises:
            ValueError: ``bandwidth_bps`` is not a positive finite number, or another value is bad.
        """
        if isinstance(bandwidth_bps, bool) or not isinstance(bandwidth_bps, (int, float)):
            raise TypeError("bandwidth_bps must be a number")
        if not math.isfinite(bandwidth_bps) or bandwidth_bps <= 0:
            raise ValueError(f"neighbour {id!r}: bandwidth must be > 0 bit/s, got {bandwidth_bps}")
        return cls(id=id, prop_s=prop_s, trans_s_per_byte=8.0 / bandwidth_bps, sync_s=sync_s)

    @property
    def start_s(self) -> float:
        """Fixed delay before this neighbour's first byte arrives: ``prop_s + sync_s``."""
        return self.prop_s + self.sync_s

    def finish_s(self, n_shards: int, n_bytes: int, per_shard_cost_s: float) -> float:
        """Completion time of sending ``n_shards`` shards totalling ``n_bytes`` (0 if none)."""
        if n_shards == 0:
            return 0.0
        return self.start_s + n_bytes * self.trans_s_per_byte + n_shards * per_shard_cost_s


def finish_times(
    assignment: Assignment, neighbors: Sequence[Neighbor], per_shard_cost_s: float
) -> dict[str, float]:
    """Evaluates the time model on an assignment.

    Returns:
        Neighbour id -> completion time in seconds (0.0 for a neighbour that sends nothing).

    Raises:
        ValueError: the assignment names a neighbour that is not in ``neighbors``.
    """
    by_id = {n.id: n for n in neighbors}
    unknown = set(assignment) - set(by_id)
    if unknown:
        raise ValueError(f"assignment names unknown neighbours: {sorted(unknown)}")
    out = {n.id: 0.0 for n in neighbors}
    for nid, shards in assignment.items():
        n_bytes = sum(length for _, length in shards)
        out[nid] = by_id[nid].finish_s(len(shards), n_bytes, per_shard_cost_s)
    return out


def makespan(
    assignment: Assignment, neighbors: Sequence[Neighbor], per_shard_cost_s: float
) -> float:
    """The plan's completion time theta: the latest neighbour finish time, in seconds."""
    return max(finish_times(assignment, neighbors, per_shard_cost_s).values(), default=0.0)


@dataclass(frozen=True)
class Plan:
    """A replication policy: which neighbour sends which byte ranges of the state.

    Attributes:
        method: The method that produced it (``"chaos"``, ``"scan"``, ``"milp"``, ...).
        layout: ``"flat"`` or ``"per-tensor"``.
        shard_size: The shard size s, in bytes.
        assignment: Neighbour id -> ``[(offset, length), ...]`` ranges of the flat state stream.
            The ranges are disjoint and cover the state exactly. Neighbours that send nothing
            map to an empty list.
        makespan_s: The model's completion time theta for this assignment, in seconds.
        state_bytes: Total size of the state, in bytes.
        per_shard_cost_s: The per-shard cost c used by the model, in seconds.
        solve_s: Wall time spent planning, in seconds.
        proven_optimal: For ``"milp"``: whether CBC proved every solve it relied on optimal.
            ``None`` for the heuristics.
    """

    method: str
    layout: str
    shard_size: int
    assignment: dict[str, list[tuple[int, int]]]
    makespan_s: float
    state_bytes: int
    per_shard_cost_s: float
    solve_s: float = 0.0
    proven_optimal: bool | None = None
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def num_shards(self) -> int:
        """Total number of shards in the plan."""
        return sum(len(v) for v in self.assignment.values())

    def finish_times(self, neighbors: Sequence[Neighbor]) -> dict[str, float]:
        """Per-neighbour completion times of this plan under the time model, in seconds."""
        return finish_times(self.assignment, neighbors, self.per_shard_cost_s)
