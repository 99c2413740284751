"""``chaos-bench control``: control-plane figures from real daemons on loopback.

Measured, with the daemon's default heartbeat settings (0.5 s / 1.5 s):

* ``scale_in_ms``, ``connect_link_ms``, ``disconnect_link_ms``: control-path completion of each
  primitive, from the client's request to the new policy being acknowledged by every member: from
  the wall-clock time just before the client sends the request to the ``primitive_done`` event
  the scheduler logs once the last member's acknowledgement is in (same host, same clock; the
  event is written after the answer is sent, so it errs late). The client talks to its own
  daemon over a connection that is already up (a status request goes first, so no TCP handshake
  is timed). These primitives overlap training, so this is not a training stall; the stall is
  measured with the data plane (``chaos-bench primitives``).
* ``client_round_trip_ms``: the same requests timed by the client until the answer is back, i.e.
  plus the answer's way from the scheduler through the client's daemon.
* ``scheduler_side_ms``: the scheduler's own figure, from receiving the request to the last
  acknowledgement, without the client's hops.
* ``failure_detection_s``: from ``kill -9`` of a member to the last survivor installing the view
  without it (from the survivors' JSONL event logs; same host, same clock).
* ``reelection_s``: from ``kill -9`` of the scheduler to the last survivor following the new one.
* ``idle_cpu_percent``: CPU of an idle daemon in percent of one core (mean over the daemons;
  ``idle_cpu_percent_max`` is the busiest one, the scheduler).
* ``cpu_ms``: the CPU that one connect-link or disconnect-link costs the whole control plane:
  every daemon's CPU time (all its threads, from ``/proc/PID/task/*/schedstat``, in
  nanoseconds) over a fixed ``CPU_WINDOW_S`` from the request, minus what the same daemons
  use idle over as long. A connect-link's window holds its measurement: the pings, the commit,
  and the link's bandwidth probe. Nothing polls the daemons inside the window. On a device that
  trains, this is CPU taken from the trainer while the primitive runs.
* ``cpu_split_ms``: the same, split into the daemons' event loops (their main threads: the
  Python that handles each message) and their other threads (ZeroMQ's I/O thread, which is also
  where the kernel's socket work for the daemon's traffic is charged).
"""

from __future__ import annotations

import contextlib
import functools
import json
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import psutil

from chaos.daemon.client import DaemonClient
from chaos.daemon.config import DaemonConfig, ipc_endpoint_for
from chaos.daemon.events import read_events
from chaos.errors import ChaosError
from chaos.launch import (
    daemon_command,
    free_tcp_address,
    kill_and_reap,
    spawn_daemon,
    wait_until,
)
from chaos.progress import LiveProgress
from chaos.protocol import OpResult, StatusReply

_POLL_S = 0.02
CPU_WINDOW_S = 0.5
"""The window over which a link primitive's control-plane CPU is summed (far longer than a
connect-link's measurement on loopback, tens of milliseconds)."""


def _wait(pred: Callable[[], Any], what: str, timeout_s: float = 60.0) -> Any:
    """Polls ``pred`` (a daemon that does not answer yet counts as not yet).

    Raises:
        ChaosTimeout: it did not hold within ``timeout_s``.
    """
    return wait_until(pred, timeout_s, what, poll_s=_POLL_S, tolerate=(ChaosError, OSError))


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def _summary(xs: list[float]) -> dict[str, Any]:
    """``{"p50", "p99", "n", "samples"}`` of ``xs`` (the samples rounded to 6 digits)."""
    return {
        "p50": statistics.median(xs) if xs else float("nan"),
        "p99": _pct(xs, 99),
        "n": len(xs),
        "samples": [round(x, 6) for x in xs],
    }


class _Bench:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.addr: dict[str, str] = {}

    def spawn(self, nid: str, join: str | None, neighbors: list[str]) -> None:
        run_dir = self.root / nid
        self.addr.setdefault(nid, free_tcp_address())
        argv = daemon_command(
            nid, self.addr[nid], join=self.addr[join] if join else None, neighbors=neighbors
        )
        self.procs[nid] = spawn_daemon(
            argv, run_dir, log_path=run_dir / "stderr.log", log_level="ERROR"
        )

    def status(self, nid: str) -> StatusReply:
        with DaemonClient(self.addr[nid], timeout_s=2.0) as c:
            return c.status()

    def ipc(self, nid: str) -> str:
        """``nid``'s local endpoint: operator commands (link, leave) are accepted only there
        (or from a cluster key holder)."""
        return ipc_endpoint_for(str(self.root / nid))

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
        kill_and_reap(self.procs.values(), timeout_s=10.0)


def _done_at(b: _Bench, sched: str, primitive: str, since: float) -> float:
    """When the scheduler logged ``primitive`` as acknowledged by every member (wall clock).

    The scheduler answers before it logs, so the line may follow the answer by a moment.
    """

    def logged() -> float | None:
        for e in b.events(sched):
            if e["event"] == "primitive_done" and e["primitive"] == primitive and e["ts"] >= since:
                return float(e["ts"])
        return None

    return float(_wait(logged, f"the scheduler {sched} to log {primitive}", timeout_s=10.0))


def _timed(
    b: _Bench, sched: str, primitive: str, request: Callable[[], OpResult], rec: _Samples
) -> OpResult:
    """Runs one request; records its completion, the client's round trip and the scheduler's
    own figure."""
    t_wall = time.time()
    t = time.perf_counter()
    res = request()
    rtt = time.perf_counter() - t
    if not res.ok:
        raise ChaosError(f"{primitive} failed: {res.reason} {res.detail}")
    rec.done_ms[primitive].append((_done_at(b, sched, primitive, t_wall) - t_wall) * 1e3)
    rec.rtt_ms[primitive].append(rtt * 1e3)
    rec.sched_ms[primitive].append(res.elapsed_s * 1e3)
    return res


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


def _cpu_split_s(pid: int) -> tuple[float, float]:
    """CPU time of a daemon in seconds: its event loop (the main thread) and its other threads
    (ZeroMQ's I/O thread, where the kernel's socket work is charged), in ns resolution where
    Linux gives it. Without ``/proc`` (not Linux): everything under the event loop, clock-tick
    resolution."""
    loop_ns = other_ns = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                ns = int((task / "schedstat").read_text().split()[0])
                if task.name == str(pid):
                    loop_ns += ns
                else:
                    other_ns += ns
    except OSError:
        return float(sum(psutil.Process(pid).cpu_times()[:2])), 0.0
    return loop_ns / 1e9, other_ns / 1e9


def _split_sum(pids: list[int]) -> tuple[float, float]:
    splits = [_cpu_split_s(p) for p in pids]
    return sum(x for x, _ in splits), sum(y for _, y in splits)


def _idle_cpu(b: _Bench, ids: list[str], idle_s: float) -> tuple[float, float, tuple[float, float]]:
    """Idle CPU: the mean and max per daemon in percent of one core, and the sum over the
    daemons (cores) of their event loops and of their other threads."""
    pids = [b.procs[n].pid for n in ids]
    before = [_cpu_split_s(p) for p in pids]
    t0 = time.monotonic()
    time.sleep(idle_s)
    wall = time.monotonic() - t0
    after = [_cpu_split_s(p) for p in pids]
    rate = [(sum(a) - sum(c)) / wall for a, c in zip(after, before, strict=True)]
    loop = sum(a[0] - c[0] for a, c in zip(after, before, strict=True)) / wall
    other = sum(a[1] - c[1] for a, c in zip(after, before, strict=True)) / wall
    return 100 * statistics.mean(rate), 100 * max(rate), (loop, other)


class _CpuMeter:
    """Sums the daemons' CPU over a fixed window, minus their idle use, in all and split into
    the event loops and the other threads."""

    def __init__(self, b: _Bench, ids: list[str], idle_cores: tuple[float, float]) -> None:
        self.pids = [b.procs[n].pid for n in ids]
        self.idle_cores = idle_cores  # the daemons' idle use, from _idle_cpu
        keys = ("connect_link", "disconnect_link")
        self.samples_ms: dict[str, list[float]] = {k: [] for k in keys}
        self.split_ms: dict[str, dict[str, list[float]]] = {
            k: {"event_loop": [], "other_threads": []} for k in keys
        }
        self._t0 = 0.0
        self._c0 = (0.0, 0.0)

    def start(self) -> None:
        self._t0, self._c0 = time.monotonic(), _split_sum(self.pids)

    def stop(self, key: str) -> None:
        """Waits out the window and records its CPU under ``key``."""
        time.sleep(max(0.0, self._t0 + CPU_WINDOW_S - time.monotonic()))
        loop, other = _split_sum(self.pids)
        wall = time.monotonic() - self._t0
        loop_ms = (loop - self._c0[0] - self.idle_cores[0] * wall) * 1e3
        other_ms = (other - self._c0[1] - self.idle_cores[1] * wall) * 1e3
        self.samples_ms[key].append(loop_ms + other_ms)
        self.split_ms[key]["event_loop"].append(loop_ms)
        self.split_ms[key]["other_threads"].append(other_ms)


_PRIMITIVES = {"scale_in": "scale_in_leave", "connect_link": "connect_link",
               "disconnect_link": "disconnect_link"}  # fmt: skip
"""JSON key -> the primitive's name in the scheduler's event log."""


class _Samples:
    """Per primitive (event-log name): completion, client round trip and scheduler-side (ms)."""

    def __init__(self) -> None:
        keys = _PRIMITIVES.values()
        self.done_ms: dict[str, list[float]] = {k: [] for k in keys}
        self.rtt_ms: dict[str, list[float]] = {k: [] for k in keys}
        self.sched_ms: dict[str, list[float]] = {k: [] for k in keys}


def _links(b: _Bench, ids: list[str], reps: int, rec: _Samples, cpu: _CpuMeter) -> None:
    linked = {frozenset((x.a, x.b)) for x in b.status(ids[0]).links}
    pairs = [(a, c) for a in ids for c in ids if a < c and frozenset((a, c)) not in linked]
    if not pairs:  # a full mesh (3 nodes): free one link first, untimed
        with DaemonClient(b.ipc(ids[0]), timeout_s=15.0) as cl:
            res = cl.link(ids[-1], add=False)
        if not res.ok:
            raise ChaosError(f"link remove {ids[0]}-{ids[-1]} failed: {res.reason} {res.detail}")
        _wait(lambda: len({b.status(n).epoch for n in ids}) == 1, "link removed")
        pairs = [(ids[0], ids[-1])]
    for r in range(reps):
        a, c = pairs[r % len(pairs)]
        sched = b.status(a).scheduler or ""
        with DaemonClient(b.ipc(a), timeout_s=15.0) as cl:
            cl.status()  # the connection is up before the clock starts (no TCP handshake in it)
            cpu.start()
            _timed(b, sched, "connect_link", functools.partial(cl.link, c, add=True), rec)
            cpu.stop("connect_link")

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
            cpu.start()
            _timed(b, sched, "disconnect_link", functools.partial(cl.link, c, add=False), rec)
            cpu.stop("disconnect_link")


def _scale_in(b: _Bench, ids: list[str], reps: int, rec: _Samples) -> None:
    for r in range(reps):
        sched = b.status(ids[0]).scheduler or ""
        cands = [n for n in ids[1:] if n != sched]
        victim = cands[r % len(cands)]
        with DaemonClient(b.ipc(victim), timeout_s=15.0) as cl:
            cl.status()  # the connection is up before the clock starts
            _timed(b, sched, "scale_in_leave", cl.leave, rec)
        b.procs[victim].wait(timeout=15)
        _rejoin(b, ids, victim)


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
                    (e["event"] == "scheduler_changed" and e["scheduler"] == new)
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
    with LiveProgress("control", 5, "phases") as live:
        result = _measure(nodes, repeats, scale_ins, kills, reelections, idle_s, live)
    Path(json_path).write_text(json.dumps(result, indent=2))
    _print_result(result)
    click.echo(f"wrote {json_path}")


def _measure(
    nodes: int, repeats: int, scale_ins: int, kills: int, reelections: int, idle_s: float,
    live: LiveProgress,
) -> dict[str, Any]:
    """Runs every measurement on a fresh cluster of ``nodes`` daemons, each phase done a step of
    ``live``; returns the JSON."""
    with tempfile.TemporaryDirectory(prefix="chaos-bench-control-") as tmp:
        b = _Bench(Path(tmp))
        try:
            ids = _start_cluster(b, nodes)
            live.done(f"{nodes} daemons up; idle for {idle_s:.0f} s ...")
            time.sleep(2.0)  # let the joins' follow-up measurements settle
            idle_mean, idle_max, idle_cores = _idle_cpu(b, ids, idle_s)
            live.done("link primitives ...")
            rec = _Samples()
            cpu = _CpuMeter(b, ids, idle_cores)
            _links(b, ids, repeats, rec, cpu)
            live.done("scale-in ...")
            _scale_in(b, ids, scale_ins, rec)
            live.done("kill -9 of members ...")
            detect_s = _failures(b, ids, kills)
            live.done("kill -9 of the scheduler ...")
            reelect_s = _reelections(b, ids, reelections)
        finally:
            b.close()
    return {
        "nodes": nodes,
        **{f"{k}_ms": _summary(rec.done_ms[v]) for k, v in _PRIMITIVES.items()},
        "failure_detection_s": _summary(detect_s),
        "reelection_s": _summary(reelect_s),
        "client_round_trip_ms": {k: _summary(rec.rtt_ms[v]) for k, v in _PRIMITIVES.items()},
        "scheduler_side_ms": {k: _summary(rec.sched_ms[v]) for k, v in _PRIMITIVES.items()},
        "idle_cpu_percent": idle_mean,
        "idle_cpu_percent_max": idle_max,
        "cpu_ms": {k: _summary(v) for k, v in cpu.samples_ms.items()},
        "cpu_split_ms": {
            k: {part: _summary(xs) for part, xs in v.items()} for k, v in cpu.split_ms.items()
        },
        "cpu_window_s": CPU_WINDOW_S,
        "heartbeat_interval_s": DaemonConfig.heartbeat_interval_s,  # the defaults it ran with
        "failure_timeout_s": DaemonConfig.failure_timeout_s,
    }


def _print_result(result: dict[str, Any]) -> None:
    """The terminal table of :func:`_measure`'s figures."""
    click.echo(f"{'figure':<24}{'p50':>10}{'p99':>10}{'n':>5}")
    for key in (
        "scale_in_ms",
        "connect_link_ms",
        "disconnect_link_ms",
        "failure_detection_s",
        "reelection_s",
    ):
        s = result[key]
        click.echo(f"{key:<24}{s['p50']:>10.3f}{s['p99']:>10.3f}{s['n']:>5}")
    click.echo("control-path p50 (ms): completion / client round trip / scheduler side")
    for k in _PRIMITIVES:
        rt, sd = result["client_round_trip_ms"][k], result["scheduler_side_ms"][k]
        click.echo(f"  {k:<18}{result[f'{k}_ms']['p50']:>8.3f}{rt['p50']:>8.3f}{sd['p50']:>8.3f}")
    idle_mean, idle_max = result["idle_cpu_percent"], result["idle_cpu_percent_max"]
    click.echo(f"idle daemon CPU: {idle_mean:.2f}% of one core (max {idle_max:.2f}%)")
    for k, v in result["cpu_ms"].items():
        split = result["cpu_split_ms"][k]
        click.echo(
            f"control-plane CPU per {k}: p50 {v['p50']:.2f} ms (all daemons, idle use off; "
            f"event loops {split['event_loop']['p50']:.2f}, "
            f"other threads {split['other_threads']['p50']:.2f})"
        )
