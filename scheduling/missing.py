"""Planning a pull of only the bytes a joiner does not hold.

A joiner that already holds part of the state (a base model on disk, a returning device's last
state; content-addressed chunks, see docs/state.md) needs only some ranges of the stream.
:func:`plan_missing` runs the shard planner (Algorithms 1 and 2, or the other methods) over the
concatenation of those ranges, as if they were one smaller state, and maps the shards back to
offsets of the real stream. Pure: no sockets, no files, no torch.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import replace

from chaos.scheduling.model import Neighbor, Plan, makespan
from chaos.scheduling.plan import plan_replication

__all__ = ["map_to_ranges", "plan_missing"]

Ranges = Sequence[tuple[int, int]]


def _check_ranges(ranges: Ranges) -> None:
    end = -1
    for off, length in ranges:
        if off < 0 or length <= 0:
            raise ValueError(f"range ({off}, {length}) must have offset >= 0 and length > 0")
        if off < end:
            raise ValueError("ranges must be sorted and disjoint")
        end = off + length


def map_to_ranges(
    assignment: dict[str, list[tuple[int, int]]], ranges: Ranges
) -> dict[str, list[tuple[int, int]]]:
    """Maps an assignment over the concatenation of ``ranges`` to offsets of the real stream.

    A shard that spans the end of one range and the start of the next becomes two (the bytes
    between the ranges are not pulled).

    Args:
        assignment: Neighbour id -> ``[(offset, length)]`` over the concatenated ranges.
        ranges: The sorted, disjoint ``(offset, length)`` ranges of the real stream.

    Returns:
        Neighbour id -> ``[(offset, length)]`` in the real stream, in the same order.

    Raises:
        ValueError: the ranges are not sorted and disjoint, or a shard lies beyond them.
    """
    _check_ranges(ranges)
    starts = [0]  # where each range begins in the concatenation
    for _, length in ranges:
        starts.append(starts[-1] + length)
    out: dict[str, list[tuple[int, int]]] = {}
    for nid, shards in assignment.items():
        real: list[tuple[int, int]] = []
        for v_off, v_len in shards:
            if v_off < 0 or v_len < 0 or v_off + v_len > starts[-1]:
                raise ValueError(f"shard ({v_off}, {v_len}) lies beyond the {starts[-1]} bytes")
            pos, end = v_off, v_off + v_len
            i = bisect.bisect_right(starts, pos) - 1
            while pos < end:
                r_off, r_len = ranges[i]
                take = min(end, starts[i] + r_len) - pos
                real.append((r_off + pos - starts[i], take))
                pos += take
                i += 1
        out[nid] = real
    return out


def plan_missing(
    ranges: Ranges,
    neighbors: Sequence[Neighbor],
    per_shard_cost_s: float,
    method: str = "chaos",
) -> Plan:
    """Plans the pull of only ``ranges`` of the state (the bytes the joiner lacks).

    Args:
        ranges: The sorted, disjoint ``(offset, length)`` ranges to pull.
        neighbors: The donors with their measured link parameters.
        per_shard_cost_s: The per-shard cost c, in seconds.
        method: The planner's method (as :func:`~chaos.scheduling.plan_replication`).

    Returns:
        A plan whose assignment covers exactly ``ranges``, with ``state_bytes`` their total
        and ``makespan_s`` the time model on the mapped shards.

    Raises:
        ValueError: bad ranges, or as :func:`~chaos.scheduling.plan_replication`.
    """
    _check_ranges(ranges)
    virtual = plan_replication([length for _, length in ranges], neighbors, per_shard_cost_s,
                               "flat", method)  # fmt: skip
    assignment = map_to_ranges(virtual.assignment, ranges)
    return replace(
        virtual,
        assignment=assignment,
        makespan_s=makespan(assignment, neighbors, per_shard_cost_s),
    )
