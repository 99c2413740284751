"""``chaos-emulate chaos``: a fault campaign and soak in one command.

A cluster of real devices (:mod:`chaos.emulate.runner`) trains while Poisson-timed random
faults hit it: joins of new devices, graceful leaves, ``kill -9`` of any device (the scheduler
and cut vertices of the overlay included, the whole process group), link cuts (bridges
included), partitions (a random minority or majority of the devices, close to one another in
the network, cut off from the rest) and heals (every cut link and partition restored). Killed
and departed devices are replaced by new joiners, so the cluster stays between its bounds and
the campaign can run for hours.

This module is the run loop: it follows the plan, draws each event's victims from the overlay
of that moment, injects the faults and samples the processes. The other jobs are beside it:

* :mod:`chaos.emulate.campaign_plan`: the config and the seeded event timeline
  (:func:`~chaos.emulate.campaign_plan.draw_plan`: the same seed draws the same plan);
* :mod:`chaos.emulate.campaign_metrics`: the pure measurements (cut vertices and bridges,
  lineage and step integrity, ETTR, resume times, resources), unit tested on synthetic records;
* :mod:`chaos.emulate.campaign_report`: the JSON document and its readable table.

The definitions are in docs/emulation-runs.md (*The fault campaign*).
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

from chaos.emulate.campaign_metrics import bridges, cut_vertices
from chaos.emulate.campaign_plan import DEFAULT_WEIGHTS, CampaignConfig, PlannedEvent, draw_plan
from chaos.emulate.campaign_report import format_table, report
from chaos.emulate.fleet import EmulationError, log_tail
from chaos.emulate.runner import Runner
from chaos.emulate.scenario import Event, Scenario
from chaos.launch import daemon_cli, signal_group
from chaos.progress import LiveProgress

__all__ = ["DEFAULT_WEIGHTS", "Campaign", "CampaignConfig", "format_table", "report"]

LEAVE_TIMEOUT_S = 60.0
"""A leaver still running this long after it was asked to go is killed (and reported)."""
STATUS_TIMEOUT_S = 5.0
JOIN_CONTACTS = 3
"""Contacts a joiner gets: members found running and not paused first, then its neighbours."""
JOIN_PROBES = 4
"""Members whose daemon status is asked (at once) before a join, to find its contacts."""
END_SETTLE_S = 15.0
"""After the last fault: every cut and partition is healed and the cluster trains this long."""


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
        running = [(n, d) for n, d in list(self.runner.devices.items()) if d.proc.poll() is None]
        for name, d in running:
            try:
                main = psutil.Process(d.proc.pid)
                procs = [("trainer", main)] + [("daemon", c) for c in main.children(True)
                                               if "daemon" in " ".join(c.cmdline())]  # fmt: skip
                for role, p in procs:
                    self.samples.append(
                        {
                            "t": now,
                            "node": name,
                            "proc": role,
                            "rss": p.memory_info().rss,
                            "fds": p.num_fds(),
                            "live": len(running),
                        }
                    )
            except (psutil.Error, OSError):
                continue  # it exited between the poll and the sample


def outside_partitions(
    pool: list[str], healthy: list[str], partitions: list[tuple[str, ...]], live: list[str]
) -> tuple[list[str], list[str]]:
    """A joiner's candidate neighbours and contacts while partitions hold: only devices of the
    largest group of running devices the partitions leave (a side cut off, or the rest; the
    rest on a tie), so that its new links never bridge a cut (a joiner linked to both sides
    would heal the partition through itself) and it joins where most of the cluster is. The
    pool stays as it was when none of it is in that group.

    Args:
        pool: The candidate neighbours.
        healthy: The candidate contacts.
        partitions: The sides cut off, until the next heal.
        live: The running devices.

    Returns:
        The pool and the contacts to draw from.
    """
    if not partitions:
        return pool, healthy
    cut_off = {n for side in partitions for n in side}
    groups = [[n for n in live if n not in cut_off]]
    groups += [[n for n in live if n in side] for side in partitions]
    biggest: list[str] = max(groups, key=len)  # the first (the rest) on a tie
    group = set(biggest)
    return ([n for n in pool if n in group] or pool,
            [n for n in healthy if n in group])  # fmt: skip


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
        self._t0 = time.monotonic()  # the timeline's start (set again when it starts)

    def scenario(self) -> Scenario:
        """The scenario the runner builds its network from: every device that will ever run."""
        joins = tuple(Event(at_s=e.at_s, kind="join", node=e.node)
                      for e in self.plan if e.kind == "join")  # fmt: skip
        c = self.cfg
        return Scenario(name="chaos", nodes=c.nodes, degree=c.degree, model=c.model, scale=c.scale,
                        step_time_s=c.step_time_s, step_timeout_s=c.step_timeout_s,
                        settle_s=END_SETTLE_S, seed=c.seed, inner_steps=c.inner_steps,
                        overlap=c.overlap, events=joins)  # fmt: skip

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
            t0 = self._t0 = time.monotonic()
            started = time.time()
            if isinstance(self.progress, LiveProgress):
                self.progress.reset(c.duration_s, "campaign")
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
            self._tick()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.2, left))

    def _tick(self) -> None:
        """Moves the live line (a :class:`LiveProgress`) along the campaign's duration."""
        if not isinstance(self.progress, LiveProgress):
            return
        at = min(self.cfg.duration_s, time.monotonic() - self._t0)
        status = (f"{len(self.runner.running())} running, {len(self.events)} of "
                  f"{len(self.plan)} events, {len(self.crashes)} crashes")  # fmt: skip
        self.progress.at(at, status)

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
                                          "log_tail": log_tail(d)})  # fmt: skip
                self._mark("join_failed", node=name, label=f"join_failed {name}", exit_code=code)
                self.progress(f"JOIN FAILED  {name} exited with {code}")
            elif d.gone is None:
                d.gone = "crash"
                crash = {"t": now, "node": name, "exit_code": code, "log_tail": log_tail(d)}
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
        handler = {"join": self._join, "leave": self._leave, "kill": self._kill,
                   "link_cut": self._link_cut, "partition": self._partition,
                   "heal": self._heal}[kind]  # fmt: skip
        try:
            rec = handler(ev, live)
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

    def _healthy(self, live: list[str]) -> tuple[list[str], set[str]]:
        """Up to :data:`JOIN_PROBES` members (drawn) whose daemon answers ``status`` as an
        active member, not paused and following a scheduler (a join's useful contacts), and
        the members of the view the first of them holds (empty: none answered so)."""
        probe = self.rng.sample(live, min(JOIN_PROBES, len(live)))
        with ThreadPoolExecutor(max_workers=max(1, len(probe))) as pool:
            answers = list(pool.map(self._status, probe))
        healthy: list[str] = []
        view: set[str] = set()
        for name, (code, _took, out) in zip(probe, answers, strict=True):
            try:
                st = json.loads(out) if code == 0 else {}
            except json.JSONDecodeError:
                continue
            if st.get("state") == "active" and not st.get("paused") and st.get("scheduler"):
                healthy.append(name)
                view = view or {n.get("id") for n in st.get("nodes", [])}
        return sorted(healthy), view

    def _join(self, ev: PlannedEvent, live: list[str]) -> dict[str, Any]:
        """A new device linked to ``degree`` members, drawn among the members found healthy
        when two are (else among the members of a healthy one's view, else among every member);
        its contacts are the healthy ones, then its neighbours."""
        r = self.runner
        name = str(ev.node)
        healthy, view = self._healthy(live)
        in_view = [n for n in live if n in view]
        pool = healthy if len(healthy) >= 2 else (in_view or live)
        pool, healthy = outside_partitions(pool, healthy, r.partitions, live)
        nbrs = sorted(r.join_rng.sample(pool, min(self.cfg.degree, len(pool))))
        for n in nbrs:
            r._net.add_link(name, n, r._rate(name, n))
        ranked = [n for n in healthy if n in nbrs] + [n for n in healthy if n not in nbrs]
        contacts = list(dict.fromkeys(ranked[:JOIN_CONTACTS] + nbrs))
        rec = self._mark("join", node=name, neighbors=nbrs, contacts=contacts,
                         label=f"join {name}")  # fmt: skip
        r._start_device(name, nbrs, join=contacts)
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
        side = self.runner.draw_side(live, self.rng.choice(sizes), self.rng)
        rec = self._mark("partition", label=f"partition {','.join(side)}")
        self.runner._partition(Event(at_s=0.0, kind="partition", nodes=side), rec)
        return rec

    def _heal(self, ev: PlannedEvent, live: list[str]) -> dict[str, Any]:
        rec = self._mark("heal", label="heal")
        self.runner._heal(Event(at_s=0.0, kind="heal"), rec)
        rec["label"] = f"heal ({len(rec['links'])} links, {len(rec['partitions'])} partitions)"
        return rec
