"""The emulation metrics (docs/emulation-runs.md), derived from a run's records (pure: no I/O).

* **scale-out delay**: from the scheduler receiving the join (its ``scale_out_started`` event) to
  the new node being ready with the full state (its ``scale_out_complete`` event).
* **state replication delay**: the part of scale-out spent moving state: the joiner's pull, from
  asking the donors for their manifest to the last shard verified (the trainer's
  ``replication_done``: ``elapsed_s``; ``transfer_s`` excludes the wait for the donors' step
  boundary). ``pulled_bytes`` is what it pulled, ``reused_bytes`` what it held already (chunks
  whose content address equals the donor's).
* **lower bound**: the water-filling theta over the joiner's donors, from the link parameters
  the daemons measured (the trainer's ``lower_bound_s``).
* **cluster idle time**: the sum over the other devices of the time each was blocked because of
  the scale-out: for every step that overlaps the scale-out, its duration beyond that device's
  steady step duration before the join (:func:`_steady_before`: the median of its last steps at
  the membership size it had when the join began, outside other events).
* **non-donors' rate**: each non-donor's steady step duration before the join over its mean
  step duration during the scale-out (1: it did not slow down).
* **primitive delay** (leave, link add/remove/cut, partition, heal): the stall added to the
  training step (the largest excess step duration on any device in the event's window) plus the
  control-path time (the CLI's round trip, for link add/remove).
* **continuity**: whether training went on after the last fault, and each device's outages (the
  gaps in its steps: paused, stalled or stopped).
* **failure detection time**: from ``kill -9`` to the first step every survivor ran under a
  policy without the dead node.
"""

from __future__ import annotations

import statistics
from typing import Any

from chaos.emulate.fleet import RunResult

WINDOW_S = 3.0
"""Steps this long before/after an event's interval are attributed to it (for stalls)."""
_TIMELINE_KINDS = ("join", "leave", "kill", "link_add", "link_remove", "link_cut", "partition",
                   "heal")  # fmt: skip


def _steps(result: RunResult, node: str) -> list[dict[str, Any]]:
    return [r for r in result.devices.get(node, []) if r.get("kind") == "step"]


def _overlaps(r: dict[str, Any], a: float, b: float) -> bool:
    """Whether step record ``r`` (ending at ``t``, lasting ``dur_s``) overlaps ``[a, b]``."""
    return r["t"] - r["dur_s"] < b and r["t"] > a


def _baseline(result: RunResult, node: str, busy: list[tuple[float, float]]) -> float | None:
    """Median step duration of ``node`` outside every busy interval."""
    durs = [r["dur_s"] for r in _steps(result, node)
            if not any(_overlaps(r, a, b) for a, b in busy)]  # fmt: skip
    return statistics.median(durs) if durs else None


STEADY_STEPS = 100
"""How many of a device's last steps before a join its steady step duration is taken over."""
MIN_QUIET_STEPS = 10
"""Fewer steps than this outside other events: the steady duration takes them all."""


def _steady_before(
    result: RunResult, node: str, at: float, busy: list[tuple[float, float]]
) -> float | None:
    """``node``'s steady step duration just before ``at``: the median of its last
    :data:`STEADY_STEPS` steps at the membership size (``world``) of its last step before
    ``at``, leaving out those overlapping an event when :data:`MIN_QUIET_STEPS` remain.

    A growing cluster's steps get longer with every member (a larger allreduce): a median over
    the whole run would hold a smaller cluster's steps, and a join would read as a slowdown
    that is only the cluster's size. ``None``: no step before ``at``."""
    before = [r for r in _steps(result, node) if r["t"] < at]
    if not before:
        return None
    world = before[-1].get("world")
    same = [r for r in before if r.get("world") == world][-STEADY_STEPS:]
    quiet = [r for r in same if not any(_overlaps(r, a, b) for a, b in busy)]
    return statistics.median(r["dur_s"] for r in (quiet if len(quiet) >= MIN_QUIET_STEPS
                                                  else same))  # fmt: skip


def _busy_intervals(result: RunResult) -> list[tuple[float, float]]:
    out = []
    for ev in result.harness_events:
        if ev["kind"] in _TIMELINE_KINDS:
            end = max(ev.get("ready_t", ev["t"]), ev.get("done_t", ev["t"]))
            out.append((ev["t"] - 0.5, end + WINDOW_S))
    return out


def _excess(result: RunResult, node: str, a: float, b: float, base: float) -> list[float]:
    """Per step of ``node`` overlapping ``[a, b]``: its duration beyond ``base``."""
    out = []
    for r in _steps(result, node):
        if _overlaps(r, a, b):
            out.append(max(0.0, r["dur_s"] - base))
    return out


JOIN_SLACK_S = 1.0
"""A join's daemon events and ready record are looked for from this long before its mark."""


def _daemon_event(
    result: RunResult, name: str, peer: str, after: float = 0.0
) -> dict[str, Any] | None:
    """The first daemon event ``name`` about ``peer`` since ``after`` (less the slack)."""
    hits = [e for e in result.daemon_events if e.get("event") == name and e.get("peer") == peer
            and e["ts"] >= after - JOIN_SLACK_S]  # fmt: skip
    return min(hits, key=lambda e: e["ts"]) if hits else None


def _incarnations(result: RunResult, node: str) -> list[str]:
    """The records' keys of every incarnation of ``node`` (``n6``, and a retired ``n6.n6``)."""
    return [k for k in result.devices if k.split(".")[0] == node]


def _trainer_event(
    result: RunResult, node: str, name: str, after: float = 0.0
) -> dict[str, Any] | None:
    """Event ``name`` of the first ``ready`` record of ``node`` since ``after``, of any of its
    incarnations (a device that left and came back has one per start)."""
    readies = [r for k in _incarnations(result, node) for r in result.devices[k]
               if r.get("kind") == "ready" and r["t"] >= after - JOIN_SLACK_S]  # fmt: skip
    for r in sorted(readies, key=lambda r: r["t"])[:1]:
        for ev in r.get("events", []):
            if ev.get("event") == name:
                return dict(ev)
    return None


def join_metrics(
    result: RunResult, ev: dict[str, Any], busy: list[tuple[float, float]]
) -> dict[str, Any]:
    """Scale-out, replication, lower bound and idle time of one join."""
    node = ev["node"]
    started = _daemon_event(result, "scale_out_started", node, ev["t"])
    done = _daemon_event(result, "scale_out_complete", node, ev["t"])
    rep = _trainer_event(result, node, "replication_done", ev["t"]) or {}
    out: dict[str, Any] = {"node": node, "neighbors": ev.get("neighbors", [])}
    out["scale_out_s"] = done["ts"] - started["ts"] if started and done else None
    out["replication_s"] = rep.get("elapsed_s")
    out["transfer_s"] = rep.get("transfer_s")
    out["lower_bound_s"] = rep.get("lower_bound_s")
    out["planned_s"] = rep.get("planned_s")
    out["state_bytes"] = rep.get("bytes")
    out["pulled_bytes"] = rep.get("pulled_bytes")  # what differed from what it held
    out["reused_bytes"] = rep.get("reused_bytes")
    out["donors"] = sorted((rep.get("donors") or {}).keys())
    a = started["ts"] if started else ev["t"]
    b = done["ts"] if done else ev.get("ready_t", ev["t"])
    idle = 0.0
    rates: dict[str, float] = {}
    for other in result.devices:
        if other.split(".")[0] == node:
            continue
        base = _steady_before(result, other, min(a, ev["t"]), busy)
        if base is not None:
            idle += sum(_excess(result, other, a, b, base))
            rate = _rate_ratio(result, other, a, b, base)
            if rate is not None and other.split(".")[0] not in out["donors"]:
                rates[other] = rate
    out["idle_s"] = idle
    out["join_mode"] = ev.get("join_mode")
    out["non_donor_rate"] = rates  # each non-donor's step rate during the join / its steady one
    out["non_donor_rate_min"] = min(rates.values()) if rates else None
    out.update(_catch_up_figures(result, node, ev["t"]))
    return out


def _rate_ratio(result: RunResult, node: str, a: float, b: float, base: float) -> float | None:
    """``node``'s step rate over the steps that overlap ``[a, b]`` against its steady rate
    (``base``: its steady step duration before the join, :func:`_steady_before`); ``None``
    without such a step."""
    durs = [r["dur_s"] for r in _steps(result, node) if _overlaps(r, a, b)]
    if not durs or base <= 0:
        return None
    return base / statistics.mean(durs)


def _catch_up_figures(result: RunResult, node: str, after: float) -> dict[str, Any]:
    """A catching-up joiner's figures from its trainer events: the snapshot's step, the steps
    it replayed, the step it entered at and the bytes it pulled then (``None`` for a barrier
    join)."""
    events = {
        r.get("event"): r
        for k in _incarnations(result, node)
        for r in result.devices[k]
        if r.get("kind") == "trainer_event" and r.get("t", 0.0) >= after - JOIN_SLACK_S
    }
    ready = [r for k in _incarnations(result, node) for r in result.devices[k]
             if r.get("kind") == "ready" and r["t"] >= after - JOIN_SLACK_S]  # fmt: skip
    for r in ready[:1]:
        for e in r.get("events", []):
            events.setdefault(e.get("event"), e)
    snap, entered = events.get("snapshot_pulled"), events.get("entered")
    if snap is None or entered is None:
        return {"snapshot_step": None, "entered_step": None, "replayed": None,
                "entry_pulled_bytes": None}  # fmt: skip
    return {"snapshot_step": snap.get("step"), "entered_step": entered.get("step"),
            "replayed": entered.get("replayed"),
            "entry_pulled_bytes": entered.get("pulled_bytes")}  # fmt: skip


def stall_metrics(
    result: RunResult, ev: dict[str, Any], busy: list[tuple[float, float]]
) -> dict[str, Any]:
    """The stall a leave or link primitive added to the training step."""
    a, b = ev["t"], ev.get("done_t", ev["t"]) + WINDOW_S
    stalls = []
    for node in result.devices:
        if node == ev.get("node"):
            continue
        base = _baseline(result, node, busy)
        if base is not None:
            stalls += _excess(result, node, a, b, base)
    return {"stall_s": max(stalls) if stalls else None, "control_s": ev.get("cli_s")}


def failure_metrics(result: RunResult, ev: dict[str, Any]) -> dict[str, Any]:
    """Failure detection: from the kill to every survivor stepping without the dead node."""
    dead, t_kill = ev["node"], ev["t"]
    before = {}
    for node, recs in result.devices.items():
        prior = [r for r in _steps(result, node) if r["t"] <= t_kill]
        gone = any(r.get("kind") in ("left", "checkpointed") and r["t"] <= t_kill for r in recs)
        if prior and node != dead and not gone:
            before[node] = prior[-1]
    firsts = []
    for node, last in before.items():
        later = [r for r in _steps(result, node)
                 if r["t"] > t_kill and r["epoch"] > last["epoch"] and r["world"] < last["world"]]
        if not later:
            if any(r.get("kind") in ("left", "checkpointed") for r in result.devices[node]):
                continue
            return {"detection_s": None, "survivors": len(before)}
        firsts.append(later[0]["t"])
    return {"detection_s": max(firsts) - t_kill if firsts else None, "survivors": len(before)}


def summarize(result: RunResult) -> list[dict[str, Any]]:
    """One row per timeline event with its metrics."""
    busy = _busy_intervals(result)
    rows = []
    for ev in result.harness_events:
        kind = ev["kind"]
        if kind not in _TIMELINE_KINDS:
            continue
        row: dict[str, Any] = {"event": ev.get("label", kind), "kind": kind, "t": ev["t"]}
        if kind == "join":
            row.update(join_metrics(result, ev, busy))
        elif kind == "kill":
            row.update(failure_metrics(result, ev))
        else:
            row.update(stall_metrics(result, ev, busy))
        if ev.get("note"):
            row["note"] = ev["note"]
        rows.append(row)
    return rows


def _abandoned(recs: list[dict[str, Any]]) -> set[int]:
    """The steps a device recorded last before it was evicted: a round it completed as the
    others lost it (a partition that cut it off after its last receive), whose result they
    never got and redid without it. Its state is then replaced by a pull when it joins again,
    so that step is redone work, not a second state the cluster trains on."""
    steps = sorted((float(r["t"]), int(r["step"])) for r in recs if r.get("kind") == "step")
    out: set[int] = set()
    for r in recs:  # an event is written after the step record of the update() it came in
        if r.get("kind") == "trainer_event" and r.get("event") == "evicted":
            before = [s for t, s in steps if t < float(r["t"])]
            if before:
                out.add(before[-1])
    return out


def consistency(result: RunResult) -> dict[str, int]:
    """Bitwise agreement of the members: at every step two or more devices recorded, their
    state digests must be equal. A device's last step before it was evicted is left out of the
    comparison (see :func:`_abandoned`) and counted as ``redone`` when it differed.

    Returns:
        ``{"steps_compared": N, "mismatches": M, "redone": R}``.
    """
    by_step: dict[int, set[str]] = {}
    left_out: dict[int, set[str]] = {}
    for recs in result.devices.values():
        gone = _abandoned(recs)
        for r in recs:
            if r.get("kind") == "step" and r.get("digest"):
                into = left_out if r["step"] in gone else by_step
                into.setdefault(r["step"], set()).add(r["digest"])
    counts: dict[int, int] = {}
    for recs in result.devices.values():
        for r in recs:
            if r.get("kind") == "step":
                counts[r["step"]] = counts.get(r["step"], 0) + 1
    shared = [s for s, n in counts.items() if n >= 2]
    redone = sum(1 for s in shared if left_out.get(s, set()) - by_step.get(s, set())
                 and by_step.get(s))  # fmt: skip
    return {"steps_compared": len(shared),
            "mismatches": sum(1 for s in shared if len(by_step.get(s, ())) > 1),
            "redone": redone}


GAP_FACTOR = 5.0
"""A pause between two steps of a device longer than this many times its median step interval
(and :data:`MIN_GAP_S`) is an outage."""
MIN_GAP_S = 1.0


def _gap_threshold(times: list[float]) -> float:
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return max(MIN_GAP_S, GAP_FACTOR * statistics.median(gaps)) if gaps else MIN_GAP_S


def device_outages(
    devices: dict[str, list[dict[str, Any]]],
    daemon_events: list[dict[str, Any]],
    end_t: float,
    gone: dict[str, str] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Each device's outages: the gaps in its step timeline.

    A gap is a pause between two consecutive steps (or from its last step to ``end_t``) longer
    than :data:`GAP_FACTOR` times its median step interval, and at least :data:`MIN_GAP_S`. It
    is ``paused`` when the device's daemon logged ``paused`` (its side lost the majority) during
    it, ``stopped`` when the device never stepped again although it ran to the end, and
    ``stalled`` otherwise. A device that was killed, left or was asked to go (``gone``) has no
    gap after its last step.

    Args:
        devices: Each device's records (``step`` records carry ``t``).
        daemon_events: The daemons' event logs (with ``node``, ``ts``, ``event``).
        end_t: When the run ended.
        gone: Why a device stopped early (``kill``, ``leave``, ``crash``, ...), by name.

    Returns:
        The outages by device (devices without one are left out), each
        ``{"from", "to", "s", "kind"}``.
    """
    gone = gone or {}
    pauses: dict[str, list[float]] = {}
    for e in daemon_events:
        if e.get("event") == "paused":
            pauses.setdefault(str(e.get("node")), []).append(float(e["ts"]))
    out: dict[str, list[dict[str, Any]]] = {}
    for node, recs in devices.items():
        times = [float(r["t"]) for r in recs if r.get("kind") == "step"]
        if not times:
            continue
        limit = _gap_threshold(times)
        left = any(r.get("kind") in ("left", "checkpointed") for r in recs)
        spans = [(a, b, False) for a, b in zip(times, times[1:], strict=False)]
        if not left and node.split(".")[0] not in gone:
            spans.append((times[-1], end_t, True))
        found = []
        for a, b, last in spans:
            if b - a <= limit:
                continue
            paused = any(a <= t <= b for t in pauses.get(node.split(".")[0], ()))
            kind = "paused" if paused else "stopped" if last else "stalled"
            found.append({"from": a, "to": b, "s": b - a, "kind": kind})
        if found:
            out[node] = found
    return out


def training_continued(devices: dict[str, list[dict[str, Any]]], after_t: float) -> bool:
    """Whether any device recorded a step after ``after_t`` (the last fault)."""
    return any(
        r.get("kind") == "step" and r["t"] > after_t for recs in devices.values() for r in recs
    )


def continuity(result: RunResult) -> dict[str, Any]:
    """Whether training went on after the last fault of the run, and each device's outages.

    Returns:
        ``{"training_continued", "last_fault_t", "outages": {device: [gap, ...]}}``; see
        :func:`device_outages`.
    """
    from chaos.emulate.scenario import FAULT_KINDS

    faults = [e["t"] for e in result.harness_events if e["kind"] in FAULT_KINDS]
    ends = [e["t"] for e in result.harness_events if e["kind"] == "end"]
    end_t = ends[-1] if ends else max(
        (r["t"] for recs in result.devices.values() for r in recs if "t" in r), default=0.0)
    gone = {str(e["node"]): e["kind"] for e in result.harness_events
            if e["kind"] in ("kill", "leave") and e.get("node")}  # fmt: skip
    last = max(faults, default=result.started)
    return {
        "training_continued": training_continued(result.devices, last),
        "last_fault_t": last,
        "outages": device_outages(result.devices, result.daemon_events, end_t, gone),
    }
