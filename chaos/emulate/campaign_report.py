"""The report of ``chaos-emulate chaos``: the campaign's JSON document and its readable table.

:func:`report` gathers what the run loop (:mod:`chaos.emulate.campaign`) recorded and the
measurements of :mod:`chaos.emulate.campaign_metrics` into one document; :func:`format_table`
prints its summary.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any, Protocol

from chaos.emulate.campaign_metrics import (
    annotate_load,
    annotate_members,
    audit_figures,
    ettr,
    lineage,
    lineage_times,
    mark_single,
    per_kind,
    resource_summary,
    resume_times,
    single_faults,
    step_integrity,
    world_sizes,
)
from chaos.emulate.campaign_plan import CampaignConfig, PlannedEvent
from chaos.emulate.fleet import RunResult
from chaos.emulate.metrics import device_outages
from chaos.emulate.runner import Runner

__all__ = [
    "FAULTS", "CampaignRecord", "fault_figures", "fault_rows", "format_table", "recompute",
    "report", "stored_lifetimes",
]


class CampaignRecord(Protocol):
    """What a campaign's run loop recorded, as the report reads it
    (:class:`~chaos.emulate.campaign.Campaign` is one)."""

    @property
    def cfg(self) -> CampaignConfig:
        """The campaign's config."""
        ...

    @property
    def plan(self) -> list[PlannedEvent]:
        """The planned events."""
        ...

    @property
    def runner(self) -> Runner:
        """The runner of the campaign's devices (their ``gone`` reasons)."""
        ...

    @property
    def events(self) -> list[dict[str, Any]]:
        """The harness events the campaign marked (injections, skips, crashes)."""
        ...

    @property
    def crashes(self) -> list[dict[str, Any]]:
        """Device processes that exited without being killed or asked to leave."""
        ...

    @property
    def failed_joins(self) -> list[dict[str, Any]]:
        """Joiners that exited before they were ready."""
        ...

    @property
    def ready_t(self) -> Mapping[str, float]:
        """When each device became ready."""
        ...

    @property
    def gone_t(self) -> Mapping[str, float]:
        """When each device that went was killed, left or crashed."""
        ...


FAULTS = ("leave", "kill", "link_cut", "partition", "heal", "join")


def report(camp: CampaignRecord, result: RunResult, samples: list[dict[str, Any]], started: float,
           ended: float, survivors: list[str]) -> dict[str, Any]:  # fmt: skip
    """The campaign's JSON document: per-kind figures, integrity, ETTR, resources, outages."""
    cfg = camp.cfg
    devices = result.devices
    injections = [e for e in camp.events if e["kind"] in FAULTS]
    lifetimes = {n: (camp.ready_t.get(n, math.inf), camp.gone_t.get(n, math.inf))
                 for n in devices}  # fmt: skip
    rows = fault_rows(injections, devices, result.daemon_events, lifetimes)
    hist = lineage(devices, survivors)
    integrity = step_integrity(devices, survivors)
    times = lineage_times(devices, hist)
    gone = {n: str(d.gone) for n, d in camp.runner.devices.items() if d.gone}
    outages = device_outages(devices, result.daemon_events, ended, gone)
    annotate_members(samples, result.daemon_events)
    annotate_load(samples, devices)
    return {
        "config": {**asdict(cfg), "weights": dict(cfg.weights)},
        "network": result.network,
        "note": "devices replicate a state of the model's size; only a small head trains",
        "started": started, "ended": ended, "wall_s": ended - started,
        "plan_events": len(camp.plan),
        **fault_figures(rows, injections),
        "committed_steps_lost": integrity["lost"],
        "divergent_states": integrity["divergent"],
        "integrity": integrity,
        "audit": audit_figures(devices),  # the product's own; the digests above cross-check it
        "crashed_processes": len(camp.crashes),
        "crashes": camp.crashes,
        "failed_joins": len(camp.failed_joins),
        "failed_join_details": camp.failed_joins,
        "ettr": ettr(times, started, ended),
        "resources": resource_summary(samples, camp.ready_t, cfg.warmup_s),
        "survivors": survivors,
        "lifetimes": {n: [_finite(a), _finite(b)] for n, (a, b) in lifetimes.items()},
        "outages": outages,
        "injections": rows,
        "harness_events": result.harness_events,
        "timeline": {"lineage": times, "members": world_sizes(devices)},
        "samples": samples,
        "daemon_events": result.daemon_events,
        "devices": devices,
    }  # fmt: skip


def _fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def fault_rows(
    injections: list[dict[str, Any]],
    devices: Mapping[str, list[dict[str, Any]]],
    daemon_events: list[dict[str, Any]],
    lifetimes: Mapping[str, tuple[float, float]],
) -> list[dict[str, Any]]:
    """One row per injection (see :func:`~chaos.emulate.campaign_metrics.resume_times`), with
    what the harness noted of the fault (cut vertex, scheduler, ...) and whether it came alone
    (see :func:`~chaos.emulate.campaign_metrics.mark_single`)."""
    rows = resume_times(injections, devices, daemon_events, lifetimes)
    for row, ev in zip(rows, injections, strict=True):
        for k in ("cut_vertex", "scheduler", "bridge", "majority", "connected_majority", "groups",
                  "nodes", "note"):
            if k in ev:
                row[k] = ev[k]
    mark_single(rows)
    return rows


def fault_figures(rows: list[dict[str, Any]], injections: list[dict[str, Any]]
                  ) -> dict[str, Any]:  # fmt: skip
    """The report's fault figures from :func:`fault_rows`: per kind, single faults, and
    whether every fault resumed."""
    faults = [r for r in rows if r["kind"] != "join"]
    return {"injected_faults": len(faults), "per_kind": per_kind(rows, injections),
            "single_faults": single_faults(rows),
            "all_resumed": all(r["resumed"] for r in faults)}  # fmt: skip


def stored_lifetimes(doc: Mapping[str, Any]) -> dict[str, tuple[float, float]]:
    """Each device's ``(ready, gone)`` times from a stored report (``inf``: never).

    A report written before it stored them has them rebuilt: ``ready`` from the device's
    first ``ready`` record, ``gone`` from the harness's first kill, leave, crash or failed
    join of it.

    Raises:
        KeyError, TypeError, ValueError: ``doc`` is not a campaign report.
    """
    if "lifetimes" in doc:
        return {n: (_infinite(a), _infinite(b)) for n, (a, b) in doc["lifetimes"].items()}
    gone: dict[str, float] = {}
    for e in doc["harness_events"]:
        if e["kind"] in ("kill", "leave", "leave_timeout", "crash", "join_failed"):
            gone.setdefault(str(e["node"]), float(e["t"]))
    out = {}
    for name, recs in doc["devices"].items():
        first = next((r for r in recs if r.get("kind") == "ready"), None)
        ready = float(first["t"]) if first is not None else math.inf
        out[name] = (ready, gone.get(name, math.inf))
    return out


def recompute(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc``, a stored report, with its fault, integrity and resource figures recomputed by
    this version's definitions (a run made before a figure existed gains it).

    Raises:
        KeyError, TypeError, ValueError: ``doc`` is not a campaign report.
    """
    lifetimes = stored_lifetimes(doc)
    injections = [e for e in doc["harness_events"] if e["kind"] in FAULTS]
    rows = fault_rows(injections, doc["devices"], doc["daemon_events"], lifetimes)
    ready = {n: a for n, (a, _b) in lifetimes.items() if a < math.inf}
    resources = resource_summary(doc["samples"], ready, float(doc["config"]["warmup_s"]))
    integrity = step_integrity(doc["devices"], doc["survivors"])
    return {**doc, **fault_figures(rows, injections), "injections": rows,
            "resources": resources, "integrity": integrity,
            "audit": audit_figures(doc["devices"]),
            "committed_steps_lost": integrity["lost"],
            "divergent_states": integrity["divergent"]}  # fmt: skip


def _finite(t: float) -> float | None:
    return None if math.isinf(t) else t


def _infinite(t: float | None) -> float:
    return math.inf if t is None else float(t)


def _last_error(tail: str) -> str:
    """The most telling line of a device log's tail: the last error or exception."""
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "ERROR" in ln or "Error" in ln or "refused" in ln:
            return ln[-200:]
    return lines[-1][-200:] if lines else ""


def format_table(doc: dict[str, Any]) -> str:
    """The campaign's readable summary."""
    lines = [f"network: {doc['network']}; wall {doc['wall_s']:.0f} s; "
             f"{doc['injected_faults']} faults injected"]  # fmt: skip
    lines.append(f"{'kind':<11}{'injected':>9}{'resumed':>9}{'not':>5}{'p50 s':>8}{'p99 s':>8}"
                 f"{'max s':>8}{'single':>8}{'p50 s':>8}{'p99 s':>8}  notes")  # fmt: skip
    for kind, e in doc["per_kind"].items():
        notes = []
        if kind == "kill":
            notes.append(f"{e['cut_vertex']} of a cut vertex, {e['scheduler']} of the scheduler")
        if kind == "link_cut":
            notes.append(f"{e['bridge']} of a bridge")
        if kind == "partition":
            notes.append(f"{e['majority_side']} cut off a majority")
            if e.get("no_majority"):
                notes.append(f"{e['no_majority']} left no connected majority")
        lines.append(f"{kind:<11}{e['injected']:>9}{e['resumed']:>9}{e['not_resumed']:>5}"
                     f"{_fmt_s(e['resume_p50_s']):>8}{_fmt_s(e['resume_p99_s']):>8}"
                     f"{_fmt_s(e['resume_max_s']):>8}{e['single']:>8}"
                     f"{_fmt_s(e['single_p50_s']):>8}{_fmt_s(e['single_p99_s']):>8}  "
                     f"{'; '.join(notes)}")  # fmt: skip
    one = doc["single_faults"]
    lines.append(f"single faults ({', '.join(one['kinds'])}; each on a cluster training normally "
                 f"and alone until it resumed): {one['injected']}, resumed {one['resumed']}, "
                 f"p50 {_fmt_s(one['resume_p50_s'])} s, p99 {_fmt_s(one['resume_p99_s'])} s, "
                 f"max {_fmt_s(one['resume_max_s'])} s; {one['overlapping']} overlapped "
                 f"another")  # fmt: skip
    integ = doc["integrity"]
    lines.append(f"committed steps lost: {doc['committed_steps_lost']} (of {integ['committed']} "
                 f"committed); divergent states: {doc['divergent_states']}; redone: "
                 f"{integ['redone']}; crashed processes: {doc['crashed_processes']}; failed "
                 f"joins: {doc['failed_joins']}")  # fmt: skip
    au = doc.get("audit")
    if au is not None:
        lines.append(f"state audit (the trainers' own): {au['audits']} audits, "
                     f"{au['mismatches']} mismatches, {au['healed']} healed; the harness's digest "
                     f"comparison above is its cross-check")  # fmt: skip
    e = doc["ettr"]
    if e["ettr"] is not None:
        lines.append(f"ETTR {e['ettr']:.3f}: {e['useful_steps']} useful steps x tau "
                     f"{e['tau_s'] * 1000:.1f} ms over {e['wall_s']:.0f} s wall "
                     f"({e['lost_s']:.0f} s lost)")  # fmt: skip
    res = doc["resources"]
    lines.append(f"resources after warm-up: worst RSS ratio {_fmt_s(res['worst_rss_ratio'])}, "
                 f"worst open-files ratio {_fmt_s(res['worst_fds_ratio'])}, flat within 10%: "
                 f"{res['flat_within_10pct']}; at equal cluster size: worst RSS "
                 f"{_fmt_s(res.get('worst_rss_same_size_ratio'))}, open files "
                 f"{_fmt_s(res.get('worst_fds_same_size_ratio'))}, flat within 10%: "
                 f"{res.get('flat_at_same_size')}; at equal size, data-plane links and donor "
                 f"role: worst RSS {_fmt_s(res.get('worst_rss_same_load_ratio'))}, open files "
                 f"{_fmt_s(res.get('worst_fds_same_load_ratio'))}, flat within 10%: "
                 f"{res.get('flat_at_same_load')}; settled (later half's median over the "
                 f"earlier half's, per load): worst RSS "
                 f"{_fmt_s(res.get('worst_rss_settled_ratio'))}, open files "
                 f"{_fmt_s(res.get('worst_fds_settled_ratio'))}, within 10%: "
                 f"{res.get('settled_within_10pct')}")  # fmt: skip
    for key, v in res["per_process"].items():
        lines.append(f"  {key:<14} rss {v['rss_first'] / 2**20:7.1f} -> "
                     f"{v['rss_last'] / 2**20:7.1f} MiB (max x{v['rss_max_ratio']:.3f}), fds "
                     f"{v['fds_first']} -> {v['fds_last']} (max x{v['fds_max_ratio']:.3f}) "
                     f"over {v['span_s']:.0f} s")  # fmt: skip
    bad = [r for r in doc["injections"] if not r["resumed"]]
    for r in bad[:30]:
        lines.append(
            f"  not resumed: {r['label']} at +{r['t'] - doc['started']:.0f} s: "
            f"waiting on {r['not_resumed'] or 'nobody (every device paused)'}"
        )
    for c in doc["crashes"]:
        lines.append(f"  crash: {c['node']} exit {c['exit_code']}: {_last_error(c['log_tail'])}")
    if doc["failed_joins"]:
        lines.append(f"failed joins (a joiner that exited before it was ready): "
                     f"{doc['failed_joins']}")  # fmt: skip
    for c in doc["failed_join_details"][:20]:
        lines.append(f"  join_failed: {c['node']} exit {c['exit_code']}: "
                     f"{_last_error(c['log_tail'])}")  # fmt: skip
    return "\n".join(lines)
