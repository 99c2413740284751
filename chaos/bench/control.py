"""``chaos-bench control``: control-plane figures from real daemons on loopback.

Measured, with the daemon's default heartbeat settings (0.5 s / 1.5 s):

* ``scale_in_ms``, ``connect_link_ms``, ``disconnect_link_ms``: control-path completion of each
  primitive, from the client's request to the new policy being acknowledged by every member (the
  daemon answers only then), measured by the client over a connection to its daemon that is
  already up (a status request goes first, so no TCP handshake is timed). These primitives
  overlap training, so this
  is not a training stall; the stall is measured with the data plane (a later issue).
  ``scheduler_side_ms`` is the same path seen by the scheduler (request received to the last
  acknowledgement), without the client's hops.
* ``failure_detection_s``: from ``kill -9`` of a member to the last survivor installing the view
  without it (from the survivors' JSONL event logs; same host, same clock).
* ``reelection_s``: from ``kill -9`` of the scheduler to the last survivor following the new one.
* ``idle_cpu_percent``: CPU of an idle daemon in percent of one core (mean over the daemons;
  ``idle_cpu_percent_max`` is the busiest one, the scheduler).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import psutil

from chaos.daemon.client import DaemonClient
from chaos.daemon.events import read_events
from chaos.errors import ChaosError, ChaosTimeout
from chaos.protocol import StatusReply

_POLL_S = 0.02


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(pred: Callable[[], Any], what: str, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            v = pred()
        except (ChaosError, OSError):
            v = None
        if v:
            return v
        time.sleep(_POLL_S)
    raise ChaosTimeout(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def _summary(xs: list[float]) -> dict[str, float]:
    return {"p50": statistics.median(xs) if xs else float("nan"), "p99": _pct(xs, 99), "n": len(xs)}


class _Bench:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.addr: dict[str, str] = {}

    def spawn(self, nid: str, join: str | None, neighbors: list[str]) -> None:
        run_dir = self.root / nid
        run_dir.mkdir(exist_ok=True)
        self.addr.setdefault(nid, f"tcp://127.0.0.1:{_free_port()}")
        args = [
            sys.executable,
            "-m",
            "chaos.daemon.cli",
            "start",
            "--id",
            nid,
            "--listen",
            self.addr[nid],
        ]
        if join:
            args += ["--join", self.addr[join]]
        for n in neighbors:
            args += ["--neighbor", n]
        env = {**os.environ, "CHAOS_DAEMON_DIR": str(run_dir), "CHAOS_DAEMON_LOG_LEVEL": "ERROR"}
        with open(run_dir / "stderr.log", "ab") as log:
            self.procs[nid] = subprocess.Popen(args, env=env, stdout=log, stderr=log)

    def status(self, nid: str) -> StatusReply:
        with DaemonClient(self.addr[nid], timeout_s=2.0) as c:
            return c.status()

    def alive(self) -> list[str]:
        return sorted(n for n, p in self.procs.items() if p.poll() is None)

    def converged(self, ids: list[str]) -> bool:
        want = set(ids)
        sts = [self.status(n) for n in ids]
        return all({x.id for x in s.nodes} == want and not s.paused for s in sts) and (
            len({s.scheduler for s in sts}) == 1
        )

    def events(self, nid: str) -> list[dict[str, Any]]:
        p = self.root / nid / f"events-{nid}.jsonl"
        return read_events(p) if p.exists() else []

    def kill9(self, nid: str) -> float:
        t = time.time()
        self.procs[nid].send_signal(signal.SIGKILL)
        self.procs[nid].wait(timeout=10)
        return t

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            p.wait(timeout=10)


def _is_active(b: _Bench, nid: str) -> bool:
    return b.status(nid).state == "active"


def _start_cluster(b: _Bench, n: int) -> list[str]:
    ids = [f"n{i}" for i in range(1, n + 1)]
    b.spawn(ids[0], None, [])
    _wait(lambda: b.status(ids[0]).state == "active", "founder")
    for i, nid in enumerate(ids[1:], start=1):
        nbrs = [ids[i - 1]] + ([ids[0]] if i >= 2 else [])
        b.spawn(nid, ids[i - 1], nbrs)
        _wait(functools.partial(_is_active, b, nid), f"{nid} joined")
    _wait(lambda: b.converged(ids), "cluster converged")
    return ids


def _idle_cpu(b: _Bench, ids: list[str], idle_s: float) -> tuple[float, float]:
    procs = [psutil.Process(b.procs[n].pid) for n in ids]
    before = [sum(p.cpu_times()[:2]) for p in procs]
    t0 = time.monotonic()
    time.sleep(idle_s)
    wall = time.monotonic() - t0
    pct = [100 * (sum(p.cpu_times()[:2]) - c) / wall for p, c in zip(procs, before, strict=True)]
    return statistics.mean(pct), max(pct)


def _links(
    b: _Bench, ids: list[str], reps: int, sched_ms: dict[str, list[float]]
) -> tuple[list[float], list[float]]:
    linked = {frozenset((x.a, x.b)) for x in b.status(ids[0]).links}
    pairs = [(a, c) for a in ids for c in ids if a < c and frozenset((a, c)) not in linked]
    add_ms: list[float] = []
    rm_ms: list[float] = []
    for r in range(reps):
        a, c = pairs[r % len(pairs)]
        with DaemonClient(b.addr[a], timeout_s=15.0) as cl:
            cl.status()  # the connection is up before the clock starts (no TCP handshake in it)
            t = time.perf_counter()
            res = cl.link(c, add=True)
            add_ms.append((time.perf_counter() - t) * 1e3)
            sched_ms["connect_link"].append(res.elapsed_s * 1e3)
            if not res.ok:
                raise ChaosError(f"link add {a}-{c} failed: {res.reason} {res.detail}")

            def measured(a: str = a, c: str = c) -> bool:
                return any({x.a, x.b} == {a, c} and x.bandwidth_bps for x in b.status(a).links)

            def settled(a: str = a, c: str = c) -> bool:
                # the scheduler has the measurement and every member runs its latest epoch
                # (a measurement that changes the sync policy commits one more)
                sts = [b.status(n) for n in ids]
                sched = next((s for s in sts if s.role == "scheduler"), None)
                return (
                    sched is not None
                    and any({x.a, x.b} == {a, c} and x.bandwidth_bps for x in sched.links)
                    and len({s.epoch for s in sts}) == 1
                )

            _wait(measured, "link measured")
            _wait(settled, "measurement settled")
            t = time.perf_counter()
            res = cl.link(c, add=False)
            rm_ms.append((time.perf_counter() - t) * 1e3)
            sched_ms["disconnect_link"].append(res.elapsed_s * 1e3)
            if not res.ok:
                raise ChaosError(f"link remove {a}-{c} failed: {res.reason} {res.detail}")
    return add_ms, rm_ms


def _scale_in(
    b: _Bench, ids: list[str], reps: int, sched_ms: dict[str, list[float]]
) -> list[float]:
    out: list[float] = []
    for r in range(reps):
        sched = b.status(ids[0]).scheduler
        cands = [n for n in ids[1:] if n != sched]
        victim = cands[r % len(cands)]
        with DaemonClient(b.addr[victim], timeout_s=15.0) as cl:
            cl.status()  # the connection is up before the clock starts
            t = time.perf_counter()
            res = cl.leave()
            out.append((time.perf_counter() - t) * 1e3)
            sched_ms["scale_in"].append(res.elapsed_s * 1e3)
        if not res.ok:
            raise ChaosError(f"leave of {victim} failed: {res.reason}")
        b.procs[victim].wait(timeout=15)
        _rejoin(b, ids, victim)
    return out


def _rejoin(b: _Bench, ids: list[str], nid: str) -> None:
    via = next(n for n in ids if n != nid and b.procs[n].poll() is None)
    b.spawn(nid, via, [via])
    _wait(lambda: b.converged(ids), f"{nid} back")


def _failures(b: _Bench, ids: list[str], kills: int) -> list[float]:
    out: list[float] = []
    for k in range(kills):
        sched = b.status(ids[0] if b.procs[ids[0]].poll() is None else ids[1]).scheduler
        cands = [n for n in ids if n != sched]
        victim = cands[k % len(cands)]
        survivors = [n for n in ids if n != victim]
        t_kill = b.kill9(victim)
        _wait(functools.partial(b.converged, survivors), f"{victim} removed")
        done = []
        for s in survivors:
            ev = [
                e
                for e in b.events(s)
                if e["event"] == "view_installed"
                and e["ts"] > t_kill
                and victim not in e["members"]
            ]
            done.append(ev[0]["ts"])
        out.append(max(done) - t_kill)
        _rejoin(b, ids, victim)
    return out


def _reelections(b: _Bench, ids: list[str], reps: int) -> list[float]:
    out: list[float] = []
    for _ in range(reps):
        sched = b.status(ids[-1]).scheduler
        if sched is None:
            raise ChaosError("no scheduler before the kill")
        survivors = [n for n in ids if n != sched]
        t_kill = b.kill9(sched)
        _wait(functools.partial(b.converged, survivors), "re-election")
        new = b.status(survivors[0]).scheduler
        done = []
        for s in survivors:
            ev = [
                e
                for e in b.events(s)
                if e["ts"] > t_kill
                and (
                    (e["event"] == "leader_changed" and e["scheduler"] == new)
                    or (e["event"] == "elected" and s == new)
                )
            ]
            done.append(ev[0]["ts"])
        out.append(max(done) - t_kill)
        _rejoin(b, ids, sched)
    return out


@click.command("control")
@click.option("--nodes", type=click.IntRange(3, 16), default=8, show_default=True)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False),
    required=True,
    help="Write the figures here.",
)
@click.option(
    "--repeats",
    type=click.IntRange(1),
    default=30,
    show_default=True,
    help="Samples of each link primitive.",
)
@click.option("--scale-ins", type=click.IntRange(1), default=10, show_default=True)
@click.option("--kills", type=click.IntRange(1), default=10, show_default=True)
@click.option("--reelections", type=click.IntRange(1), default=5, show_default=True)
@click.option("--idle-s", type=click.FloatRange(1.0), default=10.0, show_default=True)
def control_command(
    nodes: int,
    json_path: str,
    repeats: int,
    scale_ins: int,
    kills: int,
    reelections: int,
    idle_s: float,
) -> None:
    """Control-plane benchmark with real daemons on loopback (default heartbeat settings)."""
    with tempfile.TemporaryDirectory(prefix="chaos-bench-control-") as tmp:
        b = _Bench(Path(tmp))
        try:
            ids = _start_cluster(b, nodes)
            click.echo(f"{nodes} daemons up; idle for {idle_s:.0f} s ...")
            time.sleep(2.0)  # let the joins' follow-up measurements settle
            idle_mean, idle_max = _idle_cpu(b, ids, idle_s)
            click.echo("link primitives ...")
            sched_ms: dict[str, list[float]] = {
                "scale_in": [],
                "connect_link": [],
                "disconnect_link": [],
            }
            add_ms, rm_ms = _links(b, ids, repeats, sched_ms)
            click.echo("scale-in ...")
            leave_ms = _scale_in(b, ids, scale_ins, sched_ms)
            click.echo("kill -9 of members ...")
            detect_s = _failures(b, ids, kills)
            click.echo("kill -9 of the scheduler ...")
            reelect_s = _reelections(b, ids, reelections)
        finally:
            b.close()
    result = {
        "nodes": nodes,
        "scale_in_ms": _summary(leave_ms),
        "connect_link_ms": _summary(add_ms),
        "disconnect_link_ms": _summary(rm_ms),
        "failure_detection_s": _summary(detect_s),
        "reelection_s": _summary(reelect_s),
        "scheduler_side_ms": {k: _summary(v) for k, v in sched_ms.items()},
        "idle_cpu_percent": idle_mean,
        "idle_cpu_percent_max": idle_max,
        "heartbeat_interval_s": 0.5,
        "failure_timeout_s": 1.5,
    }
    Path(json_path).write_text(json.dumps(result, indent=2))
    click.echo(f"{'figure':<24}{'p50':>10}{'p99':>10}{'n':>5}")
    for key in (
        "scale_in_ms",
        "connect_link_ms",
        "disconnect_link_ms",
        "failure_detection_s",
        "reelection_s",
    ):
        s = result[key]
        click.echo(f"{key:<24}{s['p50']:>10.3f}{s['p99']:>10.3f}{s['n']:>5}")  # type: ignore[index]
    click.echo(f"idle daemon CPU: {idle_mean:.2f}% of one core (max {idle_max:.2f}%)")
    click.echo(f"wrote {json_path}")
