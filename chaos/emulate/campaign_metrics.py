"""The measurements of a fault campaign: pure functions over the records its devices wrote.

Unit tested on synthetic records:

* :func:`cut_vertices`, :func:`bridges`: the overlay's cut vertices and bridges at a moment;
* :func:`lineage`, :func:`step_integrity`: the committed steps lost and the divergent states,
  from the step digests every device records;
* :func:`ettr`: effective training time over wall time;
* :func:`resume_times`, :func:`per_kind`: per injection, whether and when training resumed,
  and the figures per fault kind;
* :func:`mark_single`, :func:`single_faults`: which faults hit a cluster that trained normally
  and had it to themselves until training resumed, and their figures;
* :func:`resource_summary`: RSS and open files per device over time.

The definitions are in docs/emulation-runs.md (*The fault campaign*).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

import networkx as nx

from chaos.emulate.campaign_plan import CAMPAIGN_KINDS

__all__ = [
    "SINGLE_FAULT_KINDS", "annotate_load", "annotate_members", "audit_figures", "bridges",
    "cut_vertices", "ettr", "lineage", "lineage_times", "mark_single", "per_kind",
    "resource_summary", "resume_times",
    "single_faults", "step_integrity", "step_records", "world_sizes",
]  # fmt: skip

#: The kinds that are faults for the single-fault figures (a heal ends a fault, a join is
#: growth).
SINGLE_FAULT_KINDS = ("leave", "kill", "link_cut", "partition")


# ------------------------------------------------------------------------------ the overlay


def _graph(nodes: Iterable[str], edges: Iterable[tuple[str, str]]) -> nx.Graph:
    g = nx.Graph()
    g.add_nodes_from(nodes)
    g.add_edges_from((a, b) for a, b in edges if a in g and b in g and a != b)
    return g


def cut_vertices(nodes: Iterable[str], edges: Iterable[tuple[str, str]]) -> set[str]:
    """The devices whose loss splits the overlay among ``nodes`` (its articulation points).

    Args:
        nodes: The running devices.
        edges: The overlay's links (links to other devices are ignored).
    """
    return {str(n) for n in nx.articulation_points(_graph(nodes, edges))}


def bridges(nodes: Iterable[str], edges: Iterable[tuple[str, str]]) -> set[tuple[str, str]]:
    """The links whose loss splits the overlay among ``nodes``, each as a sorted pair."""
    return {(min(a, b), max(a, b)) for a, b in nx.bridges(_graph(nodes, edges))}


# ------------------------------------------------------------------------------ step records


def audit_figures(devices: Mapping[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The product's own integrity figure: the trainers' state audit (``audit_every``), from
    the audit record of each device's last step.

    Every member runs the same audits and sees the same mismatches, so ``audits`` and
    ``mismatches`` are the most any device counted; ``healed`` sums the devices' heals (each
    is one device pulling the state again); ``disagreed_last`` lists the devices whose last
    audit found members different (0 at a clean end).
    """
    last = {}
    for n, recs in devices.items():
        audited = [r["audit"] for r in step_records(recs) if isinstance(r.get("audit"), dict)]
        if audited:
            last[n] = audited[-1]
    return {
        "devices": len(last),
        "audits": max((a["audits"] for a in last.values()), default=0),
        "mismatches": max((a["mismatches"] for a in last.values()), default=0),
        "healed": sum(a["healed"] for a in last.values()),
        "disagreed_last": sorted(n for n, a in last.items() if a.get("agreed") is False),
    }


def step_records(recs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in recs if r.get("kind") == "step" and r.get("digest")]


def lineage(devices: Mapping[str, list[dict[str, Any]]],
            survivors: Iterable[str]) -> dict[int, str]:  # fmt: skip
    """The cluster's final training history: for each step number, the digest the survivors
    hold (the most common among them; all devices' when no survivor recorded that step).

    Args:
        devices: Each device's records.
        survivors: The devices running at the end.
    """
    surv = set(survivors)
    votes: dict[int, dict[str, int]] = {}
    fallback: dict[int, dict[str, int]] = {}
    for node, recs in devices.items():
        for r in step_records(recs):
            table = votes if node in surv else fallback
            per = table.setdefault(int(r["step"]), {})
            per[r["digest"]] = per.get(r["digest"], 0) + 1
    out = {}
    for s in set(votes) | set(fallback):
        per = votes.get(s) or fallback[s]
        out[s] = max(sorted(per), key=lambda d: per[d])
    return out


def step_integrity(devices: Mapping[str, list[dict[str, Any]]],
                   survivors: Iterable[str]) -> dict[str, Any]:  # fmt: skip
    """Committed steps lost and divergent states, from the per-step digests.

    Each step record carries the digest of the trained state after that step and the world
    size of the round that produced it.

    * A step ``s`` with digest ``D`` is **committed** when at least as many devices recorded
      ``(s, D)`` as the round's world size: every member of the round holds it.
    * A committed step is **lost** when the survivors' history (:func:`lineage`) holds another
      digest at ``s``: the cluster went back and redid it differently.
    * A **divergent state** is a step at which two devices that recorded it under the same
      epoch, or two survivors (each by its last record of that step), hold different digests:
      members that must be bitwise equal are not. A survivor's record off the history is left
      out of the second rule when it is its last record of the run, or when the survivor
      replaced its state (pulled the cluster's, joining again) before its next step: a round
      it finished just as it was cut off, which the others reran without it, and on which it
      never trained; such tips are listed in ``abandoned_tips``.
    * A **redone** step is an uncommitted ``(s, D)`` off the survivors' history (a round some
      member finished and the others reran after a failure); it costs time, not correctness.

    Returns:
        ``{"steps": N, "committed": N, "lost": N, "lost_steps": [...], "divergent": N,
        "divergent_steps": [...], "redone": N, "abandoned_tips": [[node, step], ...]}`` (lists
        cut to their first 20).
    """
    surv = set(survivors)
    hist = lineage(devices, surv)
    holders: dict[tuple[int, str], set[str]] = {}
    world: dict[tuple[int, str], int] = {}
    by_epoch: dict[tuple[int, int], set[str]] = {}
    by_survivor: dict[int, dict[str, str]] = {}  # step -> survivor -> its last digest there
    tips: list[list[Any]] = []
    for node, recs in devices.items():
        steps = step_records(recs)
        pulls = sorted(float(r["t"]) for r in recs if _replaces_state(r))
        for i, r in enumerate(steps):
            key = (int(r["step"]), str(r["digest"]))
            holders.setdefault(key, set()).add(node)
            world[key] = max(world.get(key, 0), int(r.get("world", 1)))
            by_epoch.setdefault((key[0], int(r.get("epoch", 0))), set()).add(key[1])
            nxt = float(steps[i + 1]["t"]) if i + 1 < len(steps) else math.inf
            dropped = nxt == math.inf or any(float(r["t"]) < p <= nxt for p in pulls)
            if node in surv and dropped and hist.get(key[0]) != key[1]:
                tips.append([node, key[0]])  # never built on: not a second state in use
            elif node in surv:
                by_survivor.setdefault(key[0], {})[node] = key[1]
    committed = {k for k, who in holders.items() if len(who) >= world[k]}
    lost = sorted(s for s, d in committed if s in hist and hist[s] != d)
    redone = [k for k in holders if k not in committed and hist.get(k[0]) != k[1]]
    divergent = sorted(
        {s for (s, _e), ds in by_epoch.items() if len(ds) > 1}
        | {s for s, ds in by_survivor.items() if len(set(ds.values())) > 1}
    )
    return {"steps": len(hist), "committed": len(committed), "lost": len(lost),
            "lost_steps": lost[:20], "divergent": len(divergent),
            "divergent_steps": divergent[:20], "redone": len(redone),
            "abandoned_tips": tips[:20]}  # fmt: skip


def _replaces_state(rec: Mapping[str, Any]) -> bool:
    """Whether a device record marks its trainer taking a state pulled from the cluster (a
    join, or a join again), which replaces whatever it trained before."""
    if rec.get("kind") == "ready":
        return True
    return rec.get("kind") == "trainer_event" and rec.get("event") in (
        "snapshot_pulled", "replication_done")


def lineage_times(devices: Mapping[str, list[dict[str, Any]]],
                  hist: Mapping[int, str]) -> list[tuple[float, int]]:  # fmt: skip
    """When each step of the history was first completed, in time order: ``[(t, step)]``."""
    first: dict[int, float] = {}
    for recs in devices.values():
        for r in step_records(recs):
            s = int(r["step"])
            if hist.get(s) == r["digest"] and (s not in first or r["t"] < first[s]):
                first[s] = float(r["t"])
    return sorted((t, s) for s, t in first.items())


def ettr(times: list[tuple[float, int]], start: float, end: float) -> dict[str, Any]:
    """Effective training time over wall time.

    The steps of the survivors' history completed in ``[start, end]`` are the useful work;
    each is worth the cluster's normal step time ``tau``, the median interval between
    consecutive history steps over the window. ``ETTR = steps * tau / (end - start)``. A stall
    adds wall time and no step; redone work (a round rerun, a step the cluster went back on)
    adds no step either, since a history step counts once. ETTR slightly above 1 means steps
    got faster than their median (fewer members) for a while.

    Args:
        times: :func:`lineage_times`.
        start: The window's start (the cluster up).
        end: The window's end.

    Returns:
        ``{"ettr", "useful_steps", "tau_s", "wall_s", "lost_s"}`` (``lost_s``: wall time not
        covered by useful steps); ``ettr`` is ``None`` with fewer than two steps.
    """
    inside = [(t, s) for t, s in times if start <= t <= end]
    wall = max(0.0, end - start)
    if len(inside) < 2 or wall <= 0:
        return {"ettr": None, "useful_steps": len(inside), "tau_s": None, "wall_s": wall,
                "lost_s": wall}  # fmt: skip
    tau = statistics.median(b[0] - a[0] for a, b in zip(inside, inside[1:], strict=False))
    useful = len(inside) * tau
    return {"ettr": useful / wall, "useful_steps": len(inside), "tau_s": tau, "wall_s": wall,
            "lost_s": max(0.0, wall - useful)}  # fmt: skip


def resume_times(
    injections: list[dict[str, Any]],
    devices: Mapping[str, list[dict[str, Any]]],
    daemon_events: list[dict[str, Any]],
    lifetimes: Mapping[str, tuple[float, float]],
) -> list[dict[str, Any]]:
    """Per injection: did training resume, and after how long.

    Training resumed after an injection at ``t`` once every device that runs at ``t`` (not the
    fault's victim) and is not paused has completed a step that started after ``t`` (a step
    in flight at ``t`` may finish with the victim's contribution, so it does not count). A
    device is paused when its daemon logged ``paused`` (its side lost the majority) between its
    last step before ``t`` and its first step after it (after a ``heal``, only a pause after
    ``t`` counts, so a heal waits for the devices it should bring back), or when it is out of
    the cluster: not a member of the newest view any daemon installed between ``t`` and the
    next injection (the scheduler evicted it, e.g. cut off from it, and it did not join again
    in that time). A device that stops running before it steps (killed, left, crashed later)
    is not waited for. When every device paused, training did not resume.

    A device that was not a member of the newest view installed by ``t`` (it was joining, or
    joining again after an eviction) is not waited for either, except after a ``heal``: the
    fault did not stop its training, and its join is measured as a join (before, a fault that
    came while a device rejoined after the previous heal was charged the rest of that rejoin).

    Args:
        injections: The harness events (``t``, ``kind``, ``node``).
        devices: Each device's records.
        daemon_events: The daemons' event logs.
        lifetimes: Each device's ``(ready, gone)`` times (``gone`` is ``inf`` while it runs).

    Returns:
        One row per injection: ``{"t", "kind", "label", "resumed", "resume_s", "waited",
        "paused", "joining", "not_resumed"}``.
    """
    pauses: dict[str, list[float]] = {}
    views: list[tuple[float, int, frozenset[str]]] = []
    for e in daemon_events:
        if e.get("event") == "paused":
            pauses.setdefault(str(e.get("node")), []).append(float(e["ts"]))
        elif e.get("event") == "view_installed" and e.get("members"):
            views.append((float(e["ts"]), int(e.get("epoch", 0)), frozenset(e["members"])))
    views.sort()
    steps = {n: sorted((float(r["t"]) - float(r.get("dur_s", 0.0)), float(r["t"]))
                       for r in recs if r.get("kind") == "step")
             for n, recs in devices.items()}  # fmt: skip
    rows = []
    starts = sorted(float(e["t"]) for e in injections)
    for ev in injections:
        t = float(ev["t"])
        until = next((x for x in starts if x > t), math.inf)
        member = _newest([v for v in views if v[0] <= until])
        before = None if ev["kind"] == "heal" else _newest([v for v in views if v[0] <= t])
        waited, paused, joining, missing, last = [], [], [], [], t
        for n, (ready, gone) in sorted(lifetimes.items()):
            if not ready <= t < gone or n == ev.get("node"):
                continue
            if before is not None and n not in before:
                joining.append(n)  # not training at t: its join is measured as a join
                continue
            if member is not None and n not in member:
                paused.append(n)  # out of the cluster: evicted, not joined again yet
                continue
            mine = steps.get(n, [])
            nxt = next((end for start, end in mine if start > t), None)
            prev = t if ev["kind"] == "heal" else max((end for _s, end in mine if end <= t),
                                                      default=ready)  # fmt: skip
            stop = min(gone, nxt if nxt is not None else math.inf)
            if any(prev < p <= stop for p in pauses.get(n, ())):
                paused.append(n)
            elif nxt is not None and nxt < gone:
                waited.append(n)
                last = max(last, nxt)
            elif gone < math.inf:
                continue  # it went before stepping: not waited for
            else:
                missing.append(n)
        resumed = bool(waited) and not missing
        rows.append({"t": t, "kind": ev["kind"], "label": ev.get("label", ev["kind"]),
                     "resumed": resumed, "resume_s": last - t if resumed else None,
                     "waited": waited, "paused": paused, "joining": joining,
                     "not_resumed": missing})  # fmt: skip
    return rows


def _newest(views: list[tuple[float, int, frozenset[str]]]) -> frozenset[str] | None:
    """The members of the view of the highest epoch among ``views`` (``None``: no view)."""
    return max(views, key=lambda v: (v[1], v[0]))[2] if views else None


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def mark_single(rows: list[dict[str, Any]]) -> None:
    """Mark each row of :func:`resume_times` ``single`` when its fault came alone.

    A fault is single when the injection before it (of any kind) had resumed before it came,
    so it hit a cluster that was training normally, and the injection after it came only once
    it had resumed (or never, for one that did not resume), so its time to resume is its own.
    The first injection has no predecessor and counts as preceded by a resumed cluster.

    Args:
        rows: :func:`resume_times`'s rows, in time order; each gains ``single`` (bool).
    """
    order = sorted(range(len(rows)), key=lambda i: float(rows[i]["t"]))
    for k, i in enumerate(order):
        r = rows[i]
        t = float(r["t"])
        prev = rows[order[k - 1]] if k > 0 else None
        nxt = float(rows[order[k + 1]]["t"]) if k + 1 < len(order) else math.inf
        calm_before = prev is None or (
            prev["resume_s"] is not None and float(prev["t"]) + float(prev["resume_s"]) <= t)
        alone_after = r["resume_s"] is None or t + float(r["resume_s"]) <= nxt
        r["single"] = bool(calm_before and alone_after)


def _figures(mine: list[dict[str, Any]]) -> dict[str, Any]:
    took = [r["resume_s"] for r in mine if r["resume_s"] is not None]
    return {"injected": len(mine), "resumed": sum(1 for r in mine if r["resumed"]),
            "not_resumed": sum(1 for r in mine if not r["resumed"]),
            "resume_p50_s": _quantile(took, 0.5), "resume_p99_s": _quantile(took, 0.99),
            "resume_max_s": max(took) if took else None}  # fmt: skip


def single_faults(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The single-fault figures over every fault kind (:data:`SINGLE_FAULT_KINDS`).

    Args:
        rows: :func:`resume_times`'s rows, marked by :func:`mark_single`.

    Returns:
        ``{"kinds", "injected", "resumed", "not_resumed", "resume_p50_s", "resume_p99_s",
        "resume_max_s", "overlapping"}``: ``injected`` counts the single faults, ``overlapping``
        the faults of those kinds that came while another was still being recovered from.
    """
    faults = [r for r in rows if r["kind"] in SINGLE_FAULT_KINDS]
    mine = [r for r in faults if r.get("single")]
    return {"kinds": list(SINGLE_FAULT_KINDS), **_figures(mine),
            "overlapping": len(faults) - len(mine)}  # fmt: skip


def per_kind(rows: list[dict[str, Any]], events: list[dict[str, Any]]) -> dict[str, Any]:
    """The campaign's table: per kind, injections, resumed count, p50/p99 resume time, and
    the same over the kind's single faults (rows marked by :func:`mark_single`)."""
    out: dict[str, Any] = {}
    for kind in CAMPAIGN_KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        evs = [e for e in events if e["kind"] == kind]
        entry: dict[str, Any] = _figures(mine)
        one = _figures([r for r in mine if r.get("single")])
        entry["single"] = one["injected"]
        entry["single_resumed"] = one["resumed"]
        entry["single_p50_s"] = one["resume_p50_s"]
        entry["single_p99_s"] = one["resume_p99_s"]
        if kind == "kill":
            entry["cut_vertex"] = sum(1 for e in evs if e.get("cut_vertex"))
            entry["scheduler"] = sum(1 for e in evs if e.get("scheduler"))
        if kind == "link_cut":
            entry["bridge"] = sum(1 for e in evs if e.get("bridge"))
        if kind == "partition":
            entry["majority_side"] = sum(1 for e in evs if e.get("majority"))
            # no group of running devices that can reach one another holds a majority: every
            # device must pause until a heal (several faults at once can do that)
            entry["no_majority"] = sum(1 for e in evs if e.get("connected_majority") is False)
        out[kind] = entry
    return out


def annotate_members(samples: list[dict[str, Any]],
                     daemon_events: Iterable[Mapping[str, Any]]) -> None:  # fmt: skip
    """Gives each sample the size of the view its device's daemon had installed by then.

    Args:
        samples: :func:`resource_summary`'s rows; each gains ``members`` (left out before the
            device's first view).
        daemon_events: The daemons' event logs (``view_installed`` with ``members``).
    """
    views: dict[str, list[tuple[float, int]]] = {}
    for e in daemon_events:
        if e.get("event") == "view_installed" and e.get("members"):
            views.setdefault(str(e.get("node")), []).append((float(e["ts"]), len(e["members"])))
    for v in views.values():
        v.sort()
    for s in samples:
        mine = views.get(str(s["node"]), [])
        i = bisect.bisect_right(mine, (float(s["t"]), math.inf))
        if i:
            s["members"] = mine[i - 1][1]


def annotate_load(samples: list[dict[str, Any]],
                  devices: Mapping[str, list[dict[str, Any]]]) -> None:  # fmt: skip
    """Gives each trainer sample what its process was connected for: the data-plane links
    (``links``) and whether it served a joiner (``serving``) at its last step before the sample.

    Args:
        samples: :func:`resource_summary`'s rows; a trainer's gains ``links`` and ``serving``
            (left out before its first step, or where its step records lack them).
        devices: Each device's records (``step`` records with ``links`` and ``serving``).
    """
    steps = {n: sorted((float(r["t"]), int(r["links"]), bool(r.get("serving")))
                       for r in recs if r.get("kind") == "step" and "links" in r)
             for n, recs in devices.items()}  # fmt: skip
    for s in samples:
        mine = steps.get(str(s["node"]), [])
        i = bisect.bisect_right(mine, (float(s["t"]), math.inf, True))
        if s.get("proc") == "trainer" and i:
            _t, s["links"], s["serving"] = mine[i - 1]


def resource_summary(samples: list[dict[str, Any]], ready: Mapping[str, float],
                     warmup_s: float) -> dict[str, Any]:  # fmt: skip
    """RSS and open files per device and process, after warm-up: first, last, max ratio.

    A process's open files follow the cluster's size (a socket or two per peer), so besides
    the plain ratio each process is also compared at equal size: per size (the members of the
    view its daemon had installed, ``members``, else the running devices, ``live``, where the
    samples carry them), the max over the first sample at that size; the worst of those is
    ``{m}_same_size_ratio``. A trainer's open files also follow its data-plane links (a tree
    hub holds several, a leaf one; about five descriptors each) and its donor role, so
    ``{m}_same_load_ratio`` compares at equal size, links and role (``links``, ``serving``,
    see :func:`annotate_load`; a daemon's equals its same-size ratio). Growth at equal load is
    a leak; the plain ratio also moves with churn. Max over first reads one transient sample
    as growth, though (connections down during a partition, a socket per contact while a
    daemon joins again), and a first sample taken in such a dip too; ``{m}_settled_ratio``
    asks whether a level *stays*: per process and load (size, links, role) sampled at least
    :data:`SETTLED_MIN_SAMPLES` times, the median of the later half of those samples over the
    median of the earlier half, the worst of those. A leak raises the later half's median; a
    transient of a few samples moves neither.

    Args:
        samples: ``{"t", "node", "proc" ("trainer" or "daemon"), "rss", "fds"[, "members"]
            [, "live"]}`` rows (see :func:`annotate_members`).
        ready: When each device became ready.
        warmup_s: Samples earlier than this after ready are ignored.

    Returns:
        ``{"per_process": {"node/proc": {"samples", "rss_first", "rss_last", "rss_max_ratio",
        "rss_same_size_ratio", "fds_first", "fds_last", "fds_max_ratio",
        "fds_same_size_ratio", ..._same_load_ratio, ..._settled_ratio}}, "worst_rss_ratio",
        "worst_fds_ratio", "worst_{rss,fds}_same_size_ratio", "worst_{...}_same_load_ratio",
        "worst_{...}_settled_ratio", "flat_within_10pct", "flat_at_same_size",
        "flat_at_same_load", "settled_within_10pct"}``; processes with fewer than two samples
        after warm-up are left out, and a same-size ratio is ``None`` with no size sampled
        twice.
    """
    series: dict[str, list[dict[str, Any]]] = {}
    for s in samples:
        r = ready.get(s["node"])
        if r is not None and s["t"] >= r + warmup_s:
            series.setdefault(f"{s['node']}/{s['proc']}", []).append(s)
    per: dict[str, Any] = {}
    for key, rows in sorted(series.items()):
        if len(rows) < 2:
            continue
        rows.sort(key=lambda x: x["t"])
        entry: dict[str, Any] = {"samples": len(rows),
                                 "span_s": rows[-1]["t"] - rows[0]["t"]}  # fmt: skip
        for m in ("rss", "fds"):
            first = rows[0][m]
            entry[f"{m}_first"] = first
            entry[f"{m}_last"] = rows[-1][m]
            entry[f"{m}_max_ratio"] = max(x[m] for x in rows) / first if first else None
            entry[f"{m}_same_size_ratio"] = _same_size_ratio(rows, m)
            entry[f"{m}_same_load_ratio"] = _same_size_ratio(rows, m, load=True)
            entry[f"{m}_settled_ratio"] = settled_ratio(rows, m)
        per[key] = entry
    worst = {k: max((v[k] for v in per.values() if v[k] is not None), default=None)
             for k in ("rss_max_ratio", "fds_max_ratio", "rss_same_size_ratio",
                       "fds_same_size_ratio", "rss_same_load_ratio",
                       "fds_same_load_ratio", "rss_settled_ratio",
                       "fds_settled_ratio")}  # fmt: skip
    def within(keys: tuple[str, str]) -> bool | None:
        return all((w := worst[k]) is None or w <= 1.10 for k in keys) if per else None

    flat = within(("rss_max_ratio", "fds_max_ratio"))
    same = within(("rss_same_size_ratio", "fds_same_size_ratio"))
    return {"per_process": per, "worst_rss_ratio": worst["rss_max_ratio"],
            "worst_fds_ratio": worst["fds_max_ratio"],
            "worst_rss_same_size_ratio": worst["rss_same_size_ratio"],
            "worst_fds_same_size_ratio": worst["fds_same_size_ratio"],
            "worst_rss_same_load_ratio": worst["rss_same_load_ratio"],
            "worst_fds_same_load_ratio": worst["fds_same_load_ratio"],
            "flat_within_10pct": flat, "flat_at_same_size": same,
            "flat_at_same_load": within(("rss_same_load_ratio",
                                         "fds_same_load_ratio")),
            "worst_rss_settled_ratio": worst["rss_settled_ratio"],
            "worst_fds_settled_ratio": worst["fds_settled_ratio"],
            "settled_within_10pct": within(("rss_settled_ratio",
                                            "fds_settled_ratio"))}  # fmt: skip


SETTLED_MIN_SAMPLES = 4
"""The fewest samples of one process at one load that :func:`settled_ratio` compares."""


def _by_load(rows: list[dict[str, Any]], m: str, load: bool = True) -> list[list[float]]:
    """``m`` of a process's time-ordered samples, grouped by the number of devices then
    running (with ``load``, also by ``links`` and ``serving`` where a sample has them);
    samples without a size are left out."""
    groups: dict[tuple[int, int, bool], list[float]] = {}
    for x in rows:
        size = x.get("members", x.get("live"))
        if size is not None:
            key = (int(size), int(x.get("links", -1)), bool(x.get("serving"))) if load \
                else (int(size), -1, False)
            groups.setdefault(key, []).append(float(x[m]))
    return list(groups.values())


def settled_ratio(rows: list[dict[str, Any]], m: str) -> float | None:
    """The worst, over the loads (size, links, role) a process was sampled at
    :data:`SETTLED_MIN_SAMPLES` times or more, of the median of ``m`` over the later half of
    those time-ordered samples divided by the median over the earlier half; ``None`` when no
    load was sampled that often (see :func:`resource_summary`)."""
    ratios = []
    for v in _by_load(rows, m):
        if len(v) >= SETTLED_MIN_SAMPLES:
            half = len(v) // 2
            early = statistics.median(v[:half])
            if early:
                ratios.append(statistics.median(v[len(v) - half:]) / early)
    return max(ratios) if ratios else None


def _same_size_ratio(rows: list[dict[str, Any]], m: str, load: bool = False) -> float | None:
    """The worst max-over-first of ``m`` among a process's time-ordered samples taken while
    the same number of devices ran (with ``load``, also with the same ``links`` and
    ``serving`` where a sample has them); ``None`` when no such group was sampled twice."""
    ratios = [max(v) / v[0] for v in _by_load(rows, m, load) if len(v) >= 2 and v[0]]
    return max(ratios) if ratios else None


def world_sizes(devices: Mapping[str, list[dict[str, Any]]]) -> list[tuple[float, int]]:
    """The training world size over time: ``(t, world)`` of every step, time ordered."""
    return sorted((float(r["t"]), int(r.get("world", 1)))
                  for recs in devices.values() for r in step_records(recs))  # fmt: skip
