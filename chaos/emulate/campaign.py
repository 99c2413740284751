"""``chaos-emulate chaos``: a fault campaign and soak in one command.

A cluster of real devices (:mod:`chaos.emulate.runner`) trains while Poisson-timed random
faults hit it: joins of new devices, graceful leaves, ``kill -9`` of any device (the scheduler
and cut vertices of the overlay included, the whole process group), link cuts (bridges
included), partitions (a random minority or majority of the devices cut off from the rest) and
heals (every cut link and partition restored). Killed and departed devices are replaced by new
joiners, so the cluster stays between its bounds and the campaign can run for hours.

The pure parts are separate functions, unit tested on synthetic records:

* :func:`draw_plan`: the seeded event timeline (the same seed draws the same plan);
* :func:`cut_vertices`, :func:`bridges`: the overlay's cut vertices and bridges at a moment;
* :func:`lineage`, :func:`step_integrity`: the committed steps lost and the divergent states,
  from the step digests every device records;
* :func:`ettr`: effective training time over wall time;
* :func:`resume_times`: per injection, whether and when training resumed;
* :func:`resource_summary`: RSS and open files per device over time.

The definitions are in docs/emulation-runs.md (*The fault campaign*).
"""

from __future__ import annotations

import json
import math
import random
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import networkx as nx
import psutil

from chaos.emulate.metrics import device_outages
from chaos.emulate.runner import EmulationError, Runner, RunResult, _tail
from chaos.emulate.scenario import Event, Scenario
from chaos.errors import ConfigError
from chaos.launch import daemon_cli, signal_group

CAMPAIGN_KINDS: tuple[str, ...] = ("join", "leave", "kill", "link_cut", "partition", "heal")
DEFAULT_WEIGHTS: dict[str, float] = {
    "leave": 0.10,
    "kill": 0.30,
    "link_cut": 0.20,
    "partition": 0.15,
    "heal": 0.25,
}
"""How often each fault kind is drawn; joins come as replacements (and when the cluster is
below its size), each ``REPLACE_AFTER_S`` after the kill or leave it replaces."""
REPLACE_AFTER_S = (3.0, 10.0)
LEAVE_TIMEOUT_S = 60.0
"""A leaver still running this long after it was asked to go is killed (and reported)."""
STATUS_TIMEOUT_S = 5.0
END_SETTLE_S = 15.0
"""After the last fault: every cut and partition is healed and the cluster trains this long."""


# ------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class PlannedEvent:
    """One event of a campaign's timeline.

    Args:
        at_s: Seconds after the cluster is up.
        kind: One of :data:`CAMPAIGN_KINDS`.
        node: A join's new device name; ``None`` for the others (victims are drawn when the
            event happens, from the overlay of that moment).
        side: A partition's side: ``"minority"`` or ``"majority"`` of the running devices.
    """

    at_s: float
    kind: str
    node: str | None = None
    side: str | None = None


@dataclass(frozen=True)
class CampaignConfig:
    """A campaign's settings.

    Args:
        nodes: Devices at the start, and the size joiners refill the cluster to.
        duration_s: How long faults are injected (then a final heal and ``END_SETTLE_S``).
        rate_per_min: Faults per minute (a Poisson process; replacement joins come on top).
        seed: Seeds the plan and the victims.
        min_live: Never fewer running devices than this (a kill or leave is then skipped).
        max_live: Never more (a join is then skipped).
        weights: Relative frequency of each fault kind.
        cut_vertex_bias: Probability that a kill aims at a cut vertex of the overlay when there
            is one (0: every running device equally likely).
        model: The state each device replicates (see docs/emulation-runs.md).
        scale: Shrinks link rates and the state together.
        step_time_s: Emulated compute per step.
        sample_s: Seconds between RSS / open-file samples.
        warmup_s: A device's samples before this many seconds after it is ready are not the
            baseline.
        keep_majority: Skip a kill or leave that would leave fewer than a strict majority of
            the committed membership running (read from a daemon's status). No consensus
            system can go on past that bound without risking two states at one step: a
            campaign that crosses it measures a cluster that is, by design, paused for good.
            ``False``: draw them anyway (the report then shows the paused cluster).
    """

    nodes: int = 6
    duration_s: float = 600.0
    rate_per_min: float = 6.0
    seed: int = 0
    min_live: int = 3
    max_live: int = 0
    weights: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    cut_vertex_bias: float = 0.5
    model: str = "synthetic:8"
    scale: float = 0.05
    step_time_s: float = 0.05
    sample_s: float = 5.0
    warmup_s: float = 20.0
    keep_majority: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, int) or not 2 <= self.nodes <= 32:
            raise ConfigError(f"nodes must be an int in [2, 32], got {self.nodes!r}")
        for name, lo, hi in (("duration_s", 1.0, 7 * 86400.0), ("rate_per_min", 0.01, 600.0),
                             ("cut_vertex_bias", 0.0, 1.0), ("sample_s", 0.5, 600.0),
                             ("warmup_s", 0.0, 3600.0), ("step_time_s", 0.0, 60.0),
                             ("scale", 1e-6, 1.0)):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise ConfigError(f"{name} must be in [{lo}, {hi}], got {v!r}")
        if not isinstance(self.min_live, int) or not 2 <= self.min_live <= self.nodes:
            raise ConfigError(f"min_live must be an int in [2, nodes], got {self.min_live!r}")
        if not isinstance(self.max_live, int) or (self.max_live and self.max_live < self.nodes):
            raise ConfigError(f"max_live must be 0 (2 x nodes) or >= nodes: {self.max_live!r}")
        bad = set(self.weights) - set(DEFAULT_WEIGHTS)
        if bad or any(not w >= 0 for w in self.weights.values()) or not sum(self.weights.values()):
            raise ConfigError(f"weights: kinds among {sorted(DEFAULT_WEIGHTS)}, >= 0, not all 0: "
                              f"{dict(self.weights)}")  # fmt: skip

    @property
    def live_bound(self) -> int:
        """The most devices running at once."""
        return self.max_live or 2 * self.nodes


def draw_plan(cfg: CampaignConfig) -> list[PlannedEvent]:
    """The campaign's timeline: Poisson-timed faults, and joins that replace what left.

    The plan tracks how many devices run and whether a partition is in force, so it never
    drops below ``min_live``, never goes above ``live_bound``, never partitions twice before a
    heal (a partition drawn then is a heal) and heals only when something is cut. A kill or
    leave is followed, ``REPLACE_AFTER_S`` later, by a join of a new device while the cluster
    is below ``nodes``. Only the plan's shape is drawn here: victims, links and partition sides
    are drawn when the event happens, from the overlay of that moment.

    Args:
        cfg: The campaign.

    Returns:
        The events in time order; the same config gives the same plan.
    """
    rng = random.Random(f"{cfg.seed}:plan")
    rate_s = cfg.rate_per_min / 60.0
    kinds = sorted(k for k, w in cfg.weights.items() if w > 0)
    weights = [cfg.weights[k] for k in kinds]
    faults: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate_s)
        if t >= cfg.duration_s:
            break
        faults.append(round(t, 3))
    live, cut, partitioned, nxt = cfg.nodes, 0, False, cfg.nodes
    pending: list[float] = []  # replacement joins due
    out: list[PlannedEvent] = []

    def join(at: float) -> None:
        nonlocal live, nxt
        if live < cfg.live_bound:
            out.append(PlannedEvent(at, "join", node=f"n{nxt}"))
            nxt += 1
            live += 1

    for at in faults:
        for due in sorted(x for x in pending if x <= at):
            pending.remove(due)
            if live < cfg.nodes:
                join(due)
        kind = rng.choices(kinds, weights)[0]
        if kind == "partition" and partitioned:
            kind = "heal"
        if kind == "heal" and not (cut or partitioned):
            kind = "link_cut" if "link_cut" in kinds else kind
        if kind in ("kill", "leave") and live <= cfg.min_live:
            join(at)  # the cluster is at its floor: a join instead
            continue
        if kind == "partition" and live < 3:
            kind = "link_cut"
        side = None
        if kind == "partition":
            side = rng.choice(("minority", "majority"))
            partitioned = True
        elif kind == "heal":
            cut, partitioned = 0, False
        elif kind == "link_cut":
            cut += 1
        elif kind in ("kill", "leave"):
            live -= 1
            pending.append(round(at + rng.uniform(*REPLACE_AFTER_S), 3))
        out.append(PlannedEvent(at, kind, side=side))
    for due in sorted(x for x in pending if x < cfg.duration_s):
        if live < cfg.nodes:
            join(due)
    return sorted(out, key=lambda e: e.at_s)


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


def _steps(recs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
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
        for r in _steps(recs):
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
      members that must be bitwise equal are not.
    * A **redone** step is an uncommitted ``(s, D)`` off the survivors' history (a round some
      member finished and the others reran after a failure); it costs time, not correctness.

    Returns:
        ``{"steps": N, "committed": N, "lost": N, "lost_steps": [...], "divergent": N,
        "divergent_steps": [...], "redone": N}`` (lists cut to their first 20).
    """
    surv = set(survivors)
    hist = lineage(devices, surv)
    holders: dict[tuple[int, str], set[str]] = {}
    world: dict[tuple[int, str], int] = {}
    by_epoch: dict[tuple[int, int], set[str]] = {}
    by_survivor: dict[int, dict[str, str]] = {}  # step -> survivor -> its last digest there
    for node, recs in devices.items():
        for r in _steps(recs):
            key = (int(r["step"]), str(r["digest"]))
            holders.setdefault(key, set()).add(node)
            world[key] = max(world.get(key, 0), int(r.get("world", 1)))
            by_epoch.setdefault((key[0], int(r.get("epoch", 0))), set()).add(key[1])
            if node in surv:
                by_survivor.setdefault(key[0], {})[node] = key[1]
    committed = {k for k, who in holders.items() if len(who) >= world[k]}
    lost = sorted(s for s, d in committed if s in hist and hist[s] != d)
    redone = [k for k in holders if k not in committed and hist.get(k[0]) != k[1]]
    divergent = sorted({s for (s, _e), ds in by_epoch.items() if len(ds) > 1}
                       | {s for s, ds in by_survivor.items() if len(set(ds.values())) > 1})
    return {"steps": len(hist), "committed": len(committed), "lost": len(lost),
            "lost_steps": lost[:20], "divergent": len(divergent),
            "divergent_steps": divergent[:20], "redone": len(redone)}  # fmt: skip


def lineage_times(devices: Mapping[str, list[dict[str, Any]]],
                  hist: Mapping[int, str]) -> list[tuple[float, int]]:  # fmt: skip
    """When each step of the history was first completed, in time order: ``[(t, step)]``."""
    first: dict[int, float] = {}
    for recs in devices.values():
        for r in _steps(recs):
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

    Args:
        injections: The harness events (``t``, ``kind``, ``node``).
        devices: Each device's records.
        daemon_events: The daemons' event logs.
        lifetimes: Each device's ``(ready, gone)`` times (``gone`` is ``inf`` while it runs).

    Returns:
        One row per injection: ``{"t", "kind", "label", "resumed", "resume_s", "waited",
        "paused", "not_resumed"}``.
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
        inside = [v for v in views if v[0] <= until]
        member = max(inside, key=lambda v: (v[1], v[0]))[2] if inside else None
        waited, paused, missing, last = [], [], [], t
        for n, (ready, gone) in sorted(lifetimes.items()):
            if not ready <= t < gone or n == ev.get("node"):
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
                     "waited": waited, "paused": paused, "not_resumed": missing})  # fmt: skip
    return rows


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def per_kind(rows: list[dict[str, Any]], events: list[dict[str, Any]]) -> dict[str, Any]:
    """The campaign's table: per kind, injections, resumed count, p50/p99 resume time."""
    out: dict[str, Any] = {}
    for kind in CAMPAIGN_KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        evs = [e for e in events if e["kind"] == kind]
        took = [r["resume_s"] for r in mine if r["resume_s"] is not None]
        entry: dict[str, Any] = {
            "injected": len(mine), "resumed": sum(1 for r in mine if r["resumed"]),
            "not_resumed": sum(1 for r in mine if not r["resumed"]),
            "resume_p50_s": _quantile(took, 0.5), "resume_p99_s": _quantile(took, 0.99),
            "resume_max_s": max(took) if took else None,
        }  # fmt: skip
        if kind == "kill":
            entry["cut_vertex"] = sum(1 for e in evs if e.get("cut_vertex"))
            entry["scheduler"] = sum(1 for e in evs if e.get("scheduler"))
        if kind == "link_cut":
            entry["bridge"] = sum(1 for e in evs if e.get("bridge"))
        if kind == "partition":
            entry["majority_side"] = sum(1 for e in evs if e.get("majority"))
        out[kind] = entry
    return out


def resource_summary(samples: list[dict[str, Any]], ready: Mapping[str, float],
                     warmup_s: float) -> dict[str, Any]:  # fmt: skip
    """RSS and open files per device and process, after warm-up: first, last, max ratio.

    Args:
        samples: ``{"t", "node", "proc" ("trainer" or "daemon"), "rss", "fds"}`` rows.
        ready: When each device became ready.
        warmup_s: Samples earlier than this after ready are ignored.

    Returns:
        ``{"per_process": {"node/proc": {"samples", "rss_first", "rss_last", "rss_max_ratio",
        "fds_first", "fds_last", "fds_max_ratio"}}, "worst_rss_ratio", "worst_fds_ratio",
        "flat_within_10pct"}``; processes with fewer than two samples after warm-up are left
        out.
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
        per[key] = entry
    worst = {m: max((v[f"{m}_max_ratio"] for v in per.values()
                     if v[f"{m}_max_ratio"] is not None), default=None)
             for m in ("rss", "fds")}  # fmt: skip
    flat = all(w is None or w <= 1.10 for w in worst.values()) if per else None
    return {"per_process": per, "worst_rss_ratio": worst["rss"],
            "worst_fds_ratio": worst["fds"], "flat_within_10pct": flat}  # fmt: skip


# ------------------------------------------------------------------------------ running


class _Sampler:
    """Samples every device's trainer and daemon (RSS, open files) every ``period_s``."""

    def __init__(self, runner: Runner, period_s: float) -> None:
        self.runner = runner
        self.period_s = period_s
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="campaign-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def sample(self) -> None:
        now = time.time()
        for name, d in list(self.runner.devices.items()):
            if d.proc.poll() is not None:
                continue
            try:
                main = psutil.Process(d.proc.pid)
                procs = [("trainer", main)] + [("daemon", c) for c in main.children(True)
                                               if "daemon" in " ".join(c.cmdline())]  # fmt: skip
                for role, p in procs:
                    self.samples.append({"t": now, "node": name, "proc": role,
                                         "rss": p.memory_info().rss, "fds": p.num_fds()})
            except (psutil.Error, OSError):
                continue  # it exited between the poll and the sample


class Campaign:
    """Runs one campaign; :meth:`run` returns the JSON document.

    Args:
        cfg: The campaign.
        out_dir: The devices' folders go under ``out_dir/run``.
        shaped: Network namespaces and tc (root); ``False``: the unshaped loopback mode.
        progress: Called with one line per notable happening.
    """

    def __init__(self, cfg: CampaignConfig, out_dir: Path, shaped: bool,
                 progress: Callable[[str], None] | None = None) -> None:  # fmt: skip
        self.cfg = cfg
        self.out_dir = out_dir
        self.shaped = shaped
        self.progress = progress or (lambda _m: None)
        self.plan = draw_plan(cfg)
        self.rng = random.Random(f"{cfg.seed}:victims")
        self.events: list[dict[str, Any]] = []
        self.crashes: list[dict[str, Any]] = []
        self.failed_joins: list[dict[str, Any]] = []
        self._leaving: dict[str, float] = {}
        self._joining: dict[str, dict[str, Any]] = {}
        self.ready_t: dict[str, float] = {}
        self.gone_t: dict[str, float] = {}

    def scenario(self) -> Scenario:
        """The scenario the runner builds its network from: every device that will ever run."""
        joins = tuple(Event(at_s=e.at_s, kind="join", node=e.node)
                      for e in self.plan if e.kind == "join")  # fmt: skip
        c = self.cfg
        return Scenario(name="chaos", nodes=c.nodes, degree=2, model=c.model, scale=c.scale,
                        step_time_s=c.step_time_s, settle_s=END_SETTLE_S, seed=c.seed,
                        events=joins)  # fmt: skip

    def run(self) -> dict[str, Any]:
        """Runs the campaign and returns its document (see :func:`report`).

        Raises:
            EmulationError: the initial cluster did not start.
            NetworkSetupError: the network could not be built.
        """
        c = self.cfg
        with Runner(self.scenario(), self.out_dir / "run", shaped=self.shaped,
                    progress=self.progress) as runner:  # fmt: skip
            self.runner = runner
            runner.start_cluster()
            for name, d in runner.devices.items():
                rec = d.ready()
                self.ready_t[name] = float(rec["t"]) if rec else time.time()
            sampler = _Sampler(runner, c.sample_s)
            sampler.start()
            t0 = time.monotonic()
            started = time.time()
            try:
                for ev in self.plan:
                    self._wait_until(t0 + ev.at_s)
                    self._apply(ev)
                self._wait_until(t0 + c.duration_s)
                self._apply(PlannedEvent(c.duration_s, "heal"))  # the final heal
                self._wait_until(time.monotonic() + END_SETTLE_S)
                runner._mark("end")
            finally:
                sampler.stop()
                self._poll()
            ended = time.time()
            survivors = sorted(runner.running())
        result = runner.result
        return report(self, result, sampler.samples, started, ended, survivors)

    # -------------------------------------------------------------------- the loop

    def _wait_until(self, deadline: float) -> None:
        while True:
            self._poll()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.2, left))

    def _poll(self) -> None:
        """Reaps leavers, marks joiners ready, and records crashes (a device process that
        exited without being killed or asked to leave)."""
        now = time.time()
        for name, d in self.runner.devices.items():
            code = d.proc.poll()
            if name in self._joining and code is None:
                rec = d.ready()
                if rec is not None:
                    self._joining.pop(name)["ready_t"] = rec["t"]
                    self.ready_t[name] = float(rec["t"])
            if code is None:
                if name in self._leaving and time.monotonic() > self._leaving[name]:
                    self._leaving.pop(name)
                    self.progress(f"leave        {name} still running after "
                                  f"{LEAVE_TIMEOUT_S:.0f} s: killed")  # fmt: skip
                    self._mark("leave_timeout", node=name, label=f"leave_timeout {name}")
                    signal_group(d.proc, signal.SIGKILL)
                    d.proc.wait(timeout=10)
                    self.gone_t.setdefault(name, now)
                continue
            signal_group(d.proc, signal.SIGKILL)  # its daemon, if it outlived it
            self._leaving.pop(name, None)
            self._joining.pop(name, None)
            if d.gone is None and name not in self.ready_t:  # a joiner that never got in
                d.gone = "join_failed"
                self.failed_joins.append({"t": now, "node": name, "exit_code": code,
                                          "log_tail": _tail(d)})  # fmt: skip
                self._mark("join_failed", node=name, label=f"join_failed {name}", exit_code=code)
                self.progress(f"JOIN FAILED  {name} exited with {code}")
            elif d.gone is None:
                d.gone = "crash"
                crash = {"t": now, "node": name, "exit_code": code, "log_tail": _tail(d)}
                self.crashes.append(crash)
                self._mark("crash", node=name, label=f"crash {name}", exit_code=code)
                self.progress(f"CRASH        {name} exited with {code}")
            self.gone_t.setdefault(name, now)

    def _mark(self, kind: str, **fields: Any) -> dict[str, Any]:
        rec = self.runner._mark(kind, **fields)
        self.events.append(rec)
        return rec

    def live(self) -> list[str]:
        """Running members: devices that are ready (joined with the state), not asked to go.
        Victims and a joiner's neighbours are drawn among them."""
        return sorted(n for n in self.runner.running() if n in self.ready_t)

    def _apply(self, ev: PlannedEvent) -> None:
        live = self.live()
        kind = ev.kind
        if kind in ("kill", "leave") and len(live) <= self.cfg.min_live:
            self.progress(f"skip {kind}: {len(live)} devices run (floor {self.cfg.min_live})")
            return
        if kind in ("kill", "leave") and self.cfg.keep_majority and not self._majority_after(live):
            self._mark("skipped", label=f"skip {kind}", reason="majority")
            self.progress(f"skip {kind}: a strict majority of the committed membership must run")
            return
        if kind == "join" and len(self.runner.running()) >= self.cfg.live_bound:
            return
        if not live:
            self.progress(f"skip {kind}: no running member")
            return
        if kind == "partition" and len(live) < 3:
            kind = "link_cut"
        try:
            rec = getattr(self, f"_{kind}")(ev, live)
        except (EmulationError, OSError, ValueError, KeyError,
                subprocess.SubprocessError) as exc:  # fmt: skip
            rec = self._mark("harness_error", label=f"{kind} failed", error=str(exc)[-300:])
            self.progress(f"harness error on {kind}: {exc}")
            return
        note = f" ({rec['note']})" if rec.get("note") else ""
        self.progress(f"{kind:<12} {rec.get('label', '')}{note}")

    def _majority_after(self, live: list[str]) -> bool:
        """Whether a strict majority of the committed membership would still run after one
        more of ``live`` went (unknown membership: yes)."""
        for name in self.rng.sample(live, min(2, len(live))):
            code, _took, out = self._status(name)
            if code != 0:
                continue
            try:
                members = {n["id"] for n in json.loads(out).get("nodes", [])}
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
            if not members:
                continue
            cut_off = {n for side in self.runner.partitions for n in side}
            running = (members & set(live)) - cut_off
            return len(running) - 1 > len(members) / 2
        return True

    def _overlay(self, live: list[str]) -> tuple[set[tuple[str, str]], str | None, str]:
        """The overlay's links among ``live`` and the scheduler: from a daemon's status (the
        links it knows up), else the harness's links."""
        for name in self.rng.sample(live, min(2, len(live))):
            code, _took, out = self._status(name)
            if code != 0:
                continue
            try:
                st = json.loads(out)
            except json.JSONDecodeError:
                continue
            links = {(min(x["a"], x["b"]), max(x["a"], x["b"]))
                     for x in st.get("links", []) if x.get("up", True)}  # fmt: skip
            if links:
                return links, st.get("scheduler"), "daemon"
        edges = {(min(a, b), max(a, b)) for a, b in self.runner._net.links()}
        return edges, None, "harness"

    def _status(self, name: str) -> tuple[int, float, str]:
        t0 = time.monotonic()
        try:
            res = subprocess.run(daemon_cli("status", "--json"), capture_output=True, text=True,
                                 timeout=STATUS_TIMEOUT_S, env=self.runner._ipc_env(name),
                                 check=False)  # fmt: skip
        except subprocess.TimeoutExpired:
            return 1, time.monotonic() - t0, ""
        return res.returncode, time.monotonic() - t0, res.stdout

    # -------------------------------------------------------------------- the events

    def _join(self, ev: PlannedEvent, live: list[str]) -> dict[str, Any]:
        r = self.runner
        name = str(ev.node)
        nbrs = sorted(r.join_rng.sample(live, min(2, len(live))))
        for n in nbrs:
            r._net.add_link(name, n, r._rate(name, n))
        rec = self._mark("join", node=name, neighbors=nbrs, label=f"join {name}")
        r._start_device(name, nbrs)
        self._joining[name] = rec
        return rec

    def _leave(self, ev: PlannedEvent, live: list[str]) -> dict[str, Any]:
        name = self.rng.choice(live)
        links, sched, source = self._overlay(live)
        d = self.runner.devices[name]
        rec = self._mark("leave", node=name, label=f"leave {name}",
                         cut_vertex=name in cut_vertices(live, links),
                         scheduler=name == sched, overlay_from=source)  # fmt: skip
        d.gone = "leave"
        d.out.with_suffix(".leave").touch()
        self._leaving[name] = time.monotonic() + LEAVE_TIMEOUT_S
        self.gone_t[name] = rec["t"]
        return rec

    def _kill(self, ev: PlannedEvent, live: list[str]) -> dict[str, Any]:
        links, sched, source = self._overlay(live)
        cuts = sorted(cut_vertices(live, links))
        if cuts and self.rng.random() < self.cfg.cut_vertex_bias:
            name = self.rng.choice(cuts)
        else:
            name = self.rng.choice(live)
        d = self.runner.devices[name]
        rec = self._mark("kill", node=name, label=f"kill {name}", cut_vertex=name in cuts,
                         scheduler=name == sched, overlay_from=source)  # fmt: skip
        d.gone = "kill"
        rec["t"] = time.time()
        signal_group(d.proc, signal.SIGKILL)  # the trainer and its daemon: the device dies
        d.proc.wait(timeout=10)
        self.gone_t[name] = rec["t"]
        return rec

    def _link_cut(self, ev: PlannedEvent, live: list[str]) -> dict[str, Any]:
        r = self.runner
        physical = {(min(a, b), max(a, b)) for a, b in r._net.links()
                    if a in live and b in live} - r.cut  # fmt: skip
        if not physical:  # every link among the members is cut already: not an injection
            return self._mark("skipped", label="link_cut skipped: every link is cut")
        a, b = self.rng.choice(sorted(physical))
        links, _sched, source = self._overlay(live)
        rec = self._mark("link_cut", a=a, b=b, label=f"link_cut {a}-{b}",
                         bridge=(a, b) in bridges(live, links | physical),
                         overlay_from=source)  # fmt: skip
        r._cut_links([(a, b)], rec)
        return rec

    def _partition(self, ev: PlannedEvent, live: list[str]) -> dict[str, Any]:
        n = len(live)
        minority = list(range(1, (n - 1) // 2 + 1))
        majority = list(range(n // 2 + 1, n))
        sizes = (majority if ev.side == "majority" else minority) or minority or majority
        side = tuple(sorted(self.rng.sample(live, self.rng.choice(sizes))))
        rec = self._mark("partition", label=f"partition {','.join(side)}")
        self.runner._partition(Event(at_s=0.0, kind="partition", nodes=side), rec)
        return rec

    def _heal(self, ev: PlannedEvent, live: list[str]) -> dict[str, Any]:
        rec = self._mark("heal", label="heal")
        self.runner._heal(Event(at_s=0.0, kind="heal"), rec)
        rec["label"] = f"heal ({len(rec['links'])} links, {len(rec['partitions'])} partitions)"
        return rec


# ------------------------------------------------------------------------------ the report


FAULTS = ("leave", "kill", "link_cut", "partition", "heal", "join")


def report(camp: Campaign, result: RunResult, samples: list[dict[str, Any]], started: float,
           ended: float, survivors: list[str]) -> dict[str, Any]:  # fmt: skip
    """The campaign's JSON document: per-kind figures, integrity, ETTR, resources, outages."""
    cfg = camp.cfg
    devices = result.devices
    injections = [e for e in camp.events if e["kind"] in FAULTS]
    lifetimes = {n: (camp.ready_t.get(n, math.inf), camp.gone_t.get(n, math.inf))
                 for n in devices}  # fmt: skip
    rows = resume_times(injections, devices, result.daemon_events, lifetimes)
    for row, ev in zip(rows, injections, strict=True):
        for k in ("cut_vertex", "scheduler", "bridge", "majority", "nodes", "note"):
            if k in ev:
                row[k] = ev[k]
    hist = lineage(devices, survivors)
    integrity = step_integrity(devices, survivors)
    times = lineage_times(devices, hist)
    gone = {n: str(d.gone) for n, d in camp.runner.devices.items() if d.gone}
    outages = device_outages(devices, result.daemon_events, ended, gone)
    faults = [r for r in rows if r["kind"] != "join"]
    return {
        "config": {**asdict(cfg), "weights": dict(cfg.weights)},
        "network": result.network,
        "note": "devices replicate a state of the model's size; only a small head trains",
        "started": started, "ended": ended, "wall_s": ended - started,
        "plan_events": len(camp.plan),
        "injected_faults": len(faults),
        "per_kind": per_kind(rows, injections),
        "all_resumed": all(r["resumed"] for r in faults),
        "committed_steps_lost": integrity["lost"],
        "divergent_states": integrity["divergent"],
        "integrity": integrity,
        "crashed_processes": len(camp.crashes),
        "crashes": camp.crashes,
        "failed_joins": len(camp.failed_joins),
        "failed_join_details": camp.failed_joins,
        "ettr": ettr(times, started, ended),
        "resources": resource_summary(samples, camp.ready_t, cfg.warmup_s),
        "survivors": survivors,
        "outages": outages,
        "injections": rows,
        "harness_events": result.harness_events,
        "timeline": {"lineage": times, "members": _members(devices)},
        "samples": samples,
        "daemon_events": result.daemon_events,
        "devices": devices,
    }  # fmt: skip


def _members(devices: Mapping[str, list[dict[str, Any]]]) -> list[tuple[float, int]]:
    """The training world size over time: ``(t, world)`` of every step, time ordered."""
    return sorted((float(r["t"]), int(r.get("world", 1)))
                  for recs in devices.values() for r in _steps(recs))  # fmt: skip


def _fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


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
                 f"{'max s':>8}  notes")  # fmt: skip
    for kind, e in doc["per_kind"].items():
        notes = []
        if kind == "kill":
            notes.append(f"{e['cut_vertex']} of a cut vertex, {e['scheduler']} of the scheduler")
        if kind == "link_cut":
            notes.append(f"{e['bridge']} of a bridge")
        if kind == "partition":
            notes.append(f"{e['majority_side']} cut off a majority")
        lines.append(f"{kind:<11}{e['injected']:>9}{e['resumed']:>9}{e['not_resumed']:>5}"
                     f"{_fmt_s(e['resume_p50_s']):>8}{_fmt_s(e['resume_p99_s']):>8}"
                     f"{_fmt_s(e['resume_max_s']):>8}  {'; '.join(notes)}")  # fmt: skip
    integ = doc["integrity"]
    lines.append(f"committed steps lost: {doc['committed_steps_lost']} (of {integ['committed']} "
                 f"committed); divergent states: {doc['divergent_states']}; redone: "
                 f"{integ['redone']}; crashed processes: {doc['crashed_processes']}; failed "
                 f"joins: {doc['failed_joins']}")  # fmt: skip
    e = doc["ettr"]
    if e["ettr"] is not None:
        lines.append(f"ETTR {e['ettr']:.3f}: {e['useful_steps']} useful steps x tau "
                     f"{e['tau_s'] * 1000:.1f} ms over {e['wall_s']:.0f} s wall "
                     f"({e['lost_s']:.0f} s lost)")  # fmt: skip
    res = doc["resources"]
    lines.append(f"resources after warm-up: worst RSS ratio {_fmt_s(res['worst_rss_ratio'])}, "
                 f"worst open-files ratio {_fmt_s(res['worst_fds_ratio'])}, flat within 10%: "
                 f"{res['flat_within_10pct']}")  # fmt: skip
    for key, v in res["per_process"].items():
        lines.append(f"  {key:<14} rss {v['rss_first'] / 2**20:7.1f} -> "
                     f"{v['rss_last'] / 2**20:7.1f} MiB (max x{v['rss_max_ratio']:.3f}), fds "
                     f"{v['fds_first']} -> {v['fds_last']} (max x{v['fds_max_ratio']:.3f}) "
                     f"over {v['span_s']:.0f} s")  # fmt: skip
    bad = [r for r in doc["injections"] if not r["resumed"]]
    for r in bad[:30]:
        lines.append(f"  not resumed: {r['label']} at +{r['t'] - doc['started']:.0f} s: "
                     f"waiting on {r['not_resumed'] or 'nobody (every device paused)'}")
    for c in doc["crashes"]:
        lines.append(f"  crash: {c['node']} exit {c['exit_code']}: {_last_error(c['log_tail'])}")
    if doc["failed_joins"]:
        lines.append(f"failed joins (a joiner that exited before it was ready): "
                     f"{doc['failed_joins']}")  # fmt: skip
    for c in doc["failed_join_details"][:20]:
        lines.append(f"  join_failed: {c['node']} exit {c['exit_code']}: "
                     f"{_last_error(c['log_tail'])}")  # fmt: skip
    return "\n".join(lines)
