"""Which plan a joiner executes: the scheduler's, or the reason it may not be.

The scheduler plans a join over the layout the donors registered and its measured link
parameters, per-shard cost c and start delays (docs/scheduling.md). The joiner runs that plan
as it is unless the snapshot it pulls does not fit it: a donor with work did not answer, the
layout moved, or the joiner already holds part of the state (content-addressed chunks,
docs/state.md). Then it plans with the scheduler's method and c, and says why
(``replication_executed``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from chaos.protocol import ReplicationWire
from chaos.replication.state import TrainingState
from chaos.scheduling import Neighbor, Plan, plan_missing, plan_replication
from chaos.scheduling.plan import PlanMethod

log = logging.getLogger("chaos.replication.pull")

__all__ = ["choose_plan", "plan_for_snapshot"]


def plan_for_snapshot(
    state: TrainingState, rep: ReplicationWire, neighbors: Sequence[Neighbor]
) -> Plan:
    """The plan the joiner executes for ``state`` (:func:`choose_plan` without its reason)."""
    return choose_plan(state, rep, neighbors)[0]


def choose_plan(
    state: TrainingState, rep: ReplicationWire, neighbors: Sequence[Neighbor]
) -> tuple[Plan, str]:
    """The plan the joiner executes for ``state``, and why it differs from the scheduler's.

    The scheduler's assignment runs as it is when every donor it gave work to answered and the
    stream has the planned layout. When only the runtime record (the stream's last element,
    whose size grows with the step counter's encoding) changed size, it still runs: the range
    that ends the stream is cut or stretched to the record's new end. Otherwise the joiner
    re-plans by the scheduler's method over the donors that answered and had work in its plan
    (all that answered when none of those did), with the scheduler's per-shard cost c
    (``rep.per_shard_cost_s``, measured by its monitor) and the donors' link parameters.

    Args:
        state: The joiner's state, built from the donors' manifest.
        rep: The policy's replication part (assignment, shard size, method, c).
        neighbors: The donors that published the snapshot.

    Returns:
        ``(plan, reason)``: ``reason`` is ``""`` for the scheduler's plan as it is,
        ``"runtime_record_resized"``, ``"donors_missing: a,b"``, ``"layout_changed"``, or
        ``"held_chunks: N of M bytes"`` for a joiner that already holds ``N`` bytes of the
        state (the plan covers only the rest).
    """
    if state.reused_bytes:
        return _plan_held(state, rep, neighbors)
    sizes = state.tensor_sizes()
    total = sum(sizes)
    c = float(rep.per_shard_cost_s)
    assignment = {k: [(int(o), int(n)) for o, n in v] for k, v in rep.assignment.items()}
    answered = {n.id for n in neighbors}
    busy = {k for k, v in assignment.items() if v}
    planned = sum(n for v in assignment.values() for _, n in v)
    missing = sorted(busy - answered)
    reason = f"donors_missing: {','.join(missing)}"[:256] if missing else ""
    if not missing and planned != total:
        stretched = _resize_end(assignment, planned, total, sizes[-1] if sizes else 0, rep)
        reason = "runtime_record_resized" if stretched is not None else "layout_changed"
        assignment = stretched if stretched is not None else assignment
    if not missing and sum(n for v in assignment.values() for _, n in v) == total:
        plan = Plan(method=PlanMethod(rep.method).value, layout="flat", shard_size=rep.shard_size,
                    assignment=assignment, makespan_s=rep.makespan_s, state_bytes=total,
                    per_shard_cost_s=c)  # fmt: skip
        return plan, reason
    # re-plan with the scheduler's method over the donors it gave work to (one, for
    # single-source) that answered
    used = {k for k, v in assignment.items() if sum(length for _, length in v) > 0}
    chosen = [n for n in neighbors if n.id in used] or list(neighbors)  # who answered
    log.info("the scheduler's plan does not fit the snapshot (%s); re-planning (%s, c = %g s)",
             reason, rep.method, c)  # fmt: skip
    return plan_replication(sizes, chosen, c, "flat", rep.method), reason


def _plan_held(
    state: TrainingState, rep: ReplicationWire, neighbors: Sequence[Neighbor]
) -> tuple[Plan, str]:
    """The plan for a joiner that holds part of the state already (content-addressed chunks):
    the scheduler's method, over the donors it gave work to that answered, and its c, run over
    only the missing bytes (:func:`~chaos.scheduling.plan_missing`)."""
    used = {k for k, v in rep.assignment.items() if v}
    chosen = [n for n in neighbors if n.id in used] or list(neighbors)
    reason = f"held_chunks: {state.reused_bytes} of {state.total_bytes} bytes"
    ranges = state.missing()
    c = float(rep.per_shard_cost_s)
    if not ranges:  # nothing to pull (an empty runtime record cannot happen, but is handled)
        empty = Plan(method=PlanMethod(rep.method).value, layout="flat", shard_size=rep.shard_size,
                     assignment={n.id: [] for n in chosen}, makespan_s=0.0, state_bytes=0,
                     per_shard_cost_s=c)  # fmt: skip
        return empty, reason
    log.info("the joiner holds %d of %d bytes; planning the rest (%s, c = %g s)",
             state.reused_bytes, state.total_bytes, rep.method, c)  # fmt: skip
    return plan_missing(ranges, chosen, c, rep.method), reason


def _resize_end(
    assignment: dict[str, list[tuple[int, int]]],
    planned: int,
    total: int,
    record: int,
    rep: ReplicationWire,
) -> dict[str, list[tuple[int, int]]] | None:
    """``assignment`` with the stream's end moved from ``planned`` to ``total`` bytes, if only
    the runtime record (the last ``record`` bytes) changed size; else ``None``."""
    layout = list(rep.tensor_sizes)
    start = total - record  # where the runtime record begins, in both streams
    if not layout or start != sum(layout[:-1]) or start < 0:
        return None  # another layout (or an unknown one): not only the record moved
    out: dict[str, list[tuple[int, int]]] = {}
    for nid, ranges in assignment.items():
        kept = []
        for off, n in ranges:
            end = total if off + n == planned else min(off + n, total)
            if end > off:
                kept.append((off, end - off))
        out[nid] = kept
    if sum(n for v in out.values() for _, n in v) != total:
        return None
    return out
