"""``chaos-bench primitives``: the stall that scale-in, connect-link and disconnect-link add to a
training step, with real trainer processes on loopback.

``N`` training processes (:mod:`chaos.bench.primitives_worker`, each a :class:`Trainer` with its
embedded daemon) train together and log every step's start and end. The founder ``n1`` starts
the cluster and the others join through it (a star overlay). Then, ``--repeats`` times:

* **connect-link**: ``DaemonClient.link(peer, add=True)`` between two members that are not
  linked (what ``chaos-daemon link add`` sends);
* **disconnect-link**: the same link removed again;
* **scale-in**: SIGTERM to the newest member, whose script then calls ``request_node_exit()`` at
  its next step boundary (a graceful leave); afterwards a fresh process joins, so the cluster is
  back to ``N`` members for the next round.

After each primitive the bench waits until every remaining member has run ``--settle-steps``
steps under the new policy.

**Stall.** For each primitive and each remaining member: the summed duration of the steps
spanning the primitive minus as many times the median undisturbed step duration
(``baseline_step_ms``, measured in the same run: steps outside every primitive and join window,
under an unchanged epoch). The spanning steps are the step that was running when the request
was made, then those in which the member installed a newer epoch (a new policy is installed,
and an aborted round rerun, inside that step's ``update()``), up to its first step under the
settled epoch. A connect-link's span also takes every later step that began before the new
link's bandwidth probe ended (the probe runs in the background once the link is committed; its
end is read from the embedded daemons' event logs, ``link_measured``), and it commits a second
epoch when the measurement changes the data plane. The request's step counts because the work
before the commit (a connect-link's first measurement of the new link) runs beside it. The
primitive's stall is the largest over the members (the cluster waits for its slowest). A step's
duration runs from the start of its gradient computation to the return of ``update()`` and
``check_state_replication()``. Noise can make a stall slightly negative; it is reported as
measured, and ``baseline_step_p10_ms`` / ``baseline_step_p90_ms`` show how noisy a step is.

**Null (placebo).** The worst of several members' noisy step durations exceeds the median even
when nothing happens. For each sample, the same estimator (same members, same number of steps
each) is also applied at ``NULL_DRAWS`` step numbers where every one of those members ran quiet
steps; their distribution is ``null_ms``, and ``added_p50_ms`` = stall p50 - null p50 is the
part of the stall the primitive adds beyond that bias.

**Control path** (``control_ms``): for the link primitives, the client's request to the daemon's
answer (sent once the new policy is acknowledged by every member); for scale-in, the leaver's
``request_node_exit()`` from its call to the daemon's answer to the leave. This runs while the
members train, so it is not a stall; the emulation's primitive delay is the stall plus this.
``reruns`` counts the allreduce rounds the members aborted and reran while the primitives were
applied.

**Failures.** When training does not resume after a primitive (a member crashed, or no step
completed under the new policy within the workers' timeouts), the attempt ends: the failure is
listed under ``failures`` and a fresh cluster continues, up to ``--max-failures`` times.
Samples measured before a failure are kept; a primitive that stalled training until a timeout
and then resumed is a (large) sample, not a failure.

JSON: ``{"scale_in_ms": {"p50", "p99", "n", "samples"}, "connect_link_ms": {...},
"disconnect_link_ms": {...}, "null_ms": {primitive: {...}}, "added_p50_ms": {primitive: ms},
"baseline_step_ms", "baseline_step_p10_ms",
"baseline_step_p90_ms", "baseline_steps", "control_ms": {primitive: {...}}, "reruns",
"attempts", "failures", "nodes", "repeats", "compute_s"}``, durations in milliseconds.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from chaos.bench.stall import (
    NULL_DRAWS,
    Primitive,
    null_stalls_s,
    percentile,
    span,
    summary_ms,
)
from chaos.errors import ChaosError, ConfigError
from chaos.launch import (
    LOG_LEVEL_ENV,
    ProcessExited,
    free_tcp_address,
    kill_and_reap,
    spawn_worker,
    wait_until,
)
from chaos.progress import LiveProgress

PRIMITIVES = ("scale_in", "connect_link", "disconnect_link")
WORKER_STEP_TIMEOUT_S = 10.0
"""The workers' allreduce frame timeout: far above a step here, short enough that a stuck
cluster is given up on quickly."""
WORKER_POLICY_TIMEOUT_S = 5.0
_POLL_S = 0.05


# ----------------------------------------------------------------------------- the cluster


class _Log:
    """Incremental reader of a worker's JSONL file (only new complete lines are parsed)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        self.steps: list[dict[str, Any]] = []
        self._offset = 0

    def poll(self) -> None:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self._offset += end
        for line in data[:end].splitlines():
            rec = json.loads(line)
            self.records.append(rec)
            if "t0" in rec:
                self.steps.append(rec)

    def left(self) -> dict[str, Any] | None:
        return next((r for r in self.records if r.get("left")), None)


@dataclass
class _Member:
    id: str
    address: str
    proc: subprocess.Popen[bytes]
    log: _Log
    logfile: Path
    run_dir: Path

    @property
    def ipc(self) -> str:
        """The embedded daemon's local endpoint (operator commands go there)."""
        from chaos.daemon.config import ipc_endpoint_for

        return ipc_endpoint_for(str(self.run_dir))

    def last(self) -> dict[str, Any]:
        self.log.poll()
        return self.log.steps[-1] if self.log.steps else {}


@dataclass
class _Cluster:
    root: Path
    worker_args: list[str]
    timeout_s: float
    members: dict[str, _Member] = field(default_factory=dict)
    windows: list[tuple[float, float]] = field(default_factory=list)

    def start(self, nid: str, join: str | None) -> _Member:
        address = free_tcp_address()
        out = self.root / f"{nid}.jsonl"
        logfile = self.root / f"{nid}.log"
        argv = [sys.executable, "-m", "chaos.bench.primitives_worker", "--id", nid]
        run_dir = self.root / f"{nid}.daemon"
        argv += ["--listen", address, "--out", str(out), "--daemon-dir", str(run_dir)]
        argv += self.worker_args
        argv += ["--join", join] if join else []
        env = {"TMPDIR": str(self.root), LOG_LEVEL_ENV: "WARNING"}
        proc = spawn_worker(argv, log_path=logfile, env=env, append=False)
        member = _Member(nid, address, proc, _Log(out), logfile, run_dir)
        self.members[nid] = member
        return member

    def live(self) -> list[str]:
        """Members still training (not asked to leave, not exited)."""
        return [m.id for m in self.members.values() if m.proc.poll() is None]

    def wait(self, pred: Callable[[], bool], what: str) -> None:
        """Waits until ``pred()`` holds.

        Raises:
            ChaosError: a worker exited with an error.
            ChaosTimeout: ``timeout_s`` passed.
        """

        try:
            wait_until(pred, self.timeout_s, what, poll_s=_POLL_S, watch=self._procs())
        except ProcessExited as exc:
            lines = self.members[exc.name].logfile.read_text(errors="replace").strip().splitlines()
            last = lines[-1] if lines else "(no output)"
            raise ChaosError(f"worker {exc.name} exited with code {exc.code}: {last}") from exc

    def _procs(self) -> dict[str, subprocess.Popen[bytes]]:
        return {m.id: m.proc for m in self.members.values()}

    def settled(self, ids: list[str], world: int, newer_than: int, steps: int) -> int | None:
        """The common epoch once every member of ``ids`` ran ``steps`` steps under it with
        ``world`` members, the epoch being newer than ``newer_than``; else None."""
        lasts = [self.members[n].last() for n in ids]
        epochs = {r.get("epoch") for r in lasts}
        if len(epochs) != 1 or any(r.get("world") != world for r in lasts):
            return None
        epoch = epochs.pop()
        if epoch is None or epoch <= newer_than:
            return None
        for n in ids:
            under = [r for r in self.members[n].log.steps[-steps:] if r["epoch"] == epoch]
            if len(under) < steps:
                return None
        return int(epoch)

    def probed(self, a: str, b: str, since: float) -> bool:
        """Whether a bandwidth measurement of link ``a``-``b`` ended after ``since`` (the
        daemons' event logs, ``link_measured``)."""
        pair = frozenset((a, b))
        return any(t >= since and ab == pair for t, ab in _probe_ends(self.root, (a, b)))

    def epoch(self) -> int:
        return max(int(self.members[n].last().get("epoch", -1)) for n in self.live())

    def join(self, nid: str, via: str, settle_steps: int) -> None:
        """Starts a member joining through ``via`` and waits until all train together."""
        t0 = time.time()
        before = self.epoch() if self.live() else -1
        self.start(nid, self.members[via].address)
        ids = self.live()

        def together() -> bool:
            return self.settled(ids, len(ids), before, settle_steps) is not None

        self.wait(together, f"{nid} to join")
        self.windows.append((t0, time.time()))

    def close(self) -> None:
        kill_and_reap(self._procs().values(), group=True)


# ----------------------------------------------------------------------------- primitives


def _link(cl: _Cluster, a: str, b: str, add: bool, settle_steps: int) -> Primitive:
    from chaos.daemon.client import DaemonClient

    ids = cl.live()
    before = cl.epoch()
    with DaemonClient(cl.members[a].ipc, timeout_s=cl.timeout_s) as client:
        t_req = time.time()
        res = client.link(b, add=add)
        control_s = time.time() - t_req
    if not res.ok:
        raise ChaosError(f"link {'add' if add else 'remove'} {a}-{b} refused: {res.reason}")
    epoch = -1

    def done() -> bool:
        nonlocal epoch
        epoch = cl.settled(ids, len(ids), before, settle_steps) or -1
        return epoch >= 0

    cl.wait(done, f"the policy after link {'add' if add else 'remove'} {a}-{b}")
    if not add:
        return Primitive("disconnect_link", t_req, control_s, ids, epoch)
    # the next primitive waits for the new link's bandwidth probe, which runs in the background
    cl.wait(lambda: cl.probed(a, b, t_req), f"the bandwidth probe of link {a}-{b}")
    return Primitive("connect_link", t_req, control_s, ids, epoch, link=(a, b))


def _scale_in(cl: _Cluster, leaver: str, settle_steps: int) -> Primitive:
    survivors = [n for n in cl.live() if n != leaver]
    before = cl.epoch()
    member = cl.members[leaver]
    t_req = time.time()
    member.proc.send_signal(signal.SIGTERM)  # the script leaves at its next step boundary
    epoch = -1

    def done() -> bool:
        nonlocal epoch
        epoch = cl.settled(survivors, len(survivors), before, settle_steps) or -1
        return epoch >= 0 and member.proc.poll() is not None

    cl.wait(done, f"{leaver} to leave")
    if member.proc.returncode != 0:
        raise ChaosError(f"{leaver} exited with code {member.proc.returncode} after leaving")
    member.log.poll()
    left = member.log.left()
    if left is None or left.get("t_left") is None:
        raise ChaosError(f"{leaver} exited without completing its leave request")
    return Primitive("scale_in", t_req, left["t_left"] - left["t_leave"], survivors, epoch)


def _stall_s(cl: _Cluster, p: Primitive, baseline_s: float) -> tuple[float, dict[str, int]]:
    """The primitive's stall: the worst member's extra time over the spanning steps.

    A member's spanning steps are the step that was running when the request was made (what
    happens before the commit, such as a connect-link's first measurement of the new link, runs
    beside it), the steps in which it installed a newer epoch (a policy change is installed,
    and any aborted round rerun, inside the ``update()`` of that step) up to its first step
    under the settled epoch, and every later step that began before the new link's bandwidth
    probe ended (a connect-link's probe runs in the background after the new epoch, and may
    slow those steps too).

    Returns:
        ``(stall_s, spans)``: the stall and how many steps each member's span has.
    """
    worst = float("-inf")
    spans: dict[str, int] = {}
    for n in p.survivors:
        mine = span(cl.members[n].log.steps, p, n)
        extra = sum(r["t1"] - r["t0"] for r in mine) - len(mine) * baseline_s
        worst = max(worst, extra)
        spans[n] = len(mine)
    return worst, spans


def _reruns(cl: _Cluster, p: Primitive) -> int:
    """Allreduce rounds the members aborted and reran while the primitive was applied."""
    return sum(
        1
        for n in p.survivors
        for r in cl.members[n].log.records
        if r.get("trainer_event") in ("restart", "allreduce_failed")
        and p.t_req <= r["t"] <= p.t_settled
    )


def _probe_ends(root: Path, nodes: tuple[str, ...] = ()) -> list[tuple[float, frozenset[str]]]:
    """When each bandwidth refinement of a committed link ended (``link_measured``, wall-clock),
    with the link's two ends, from the embedded daemons' event logs under ``root`` (of
    ``nodes`` only, if given)."""
    ends: list[tuple[float, frozenset[str]]] = []
    for pattern in [f"*/events-{n}.jsonl" for n in nodes] or ["*/events-*.jsonl"]:
        for path in root.glob(pattern):
            for line in path.read_text(errors="replace").splitlines():
                if '"link_measured"' not in line or not line.endswith("}"):
                    continue
                e = json.loads(line)
                if str(e.get("op_id", "")).startswith(("refine-", "confirm-")):
                    ends.append((float(e["ts"]), frozenset((e["node"], e["peer"]))))
    return ends


def _mark_windows(
    cl: _Cluster, prims: list[Primitive], probes: list[tuple[float, frozenset[str]]]
) -> None:
    for i, p in enumerate(prims):
        ends = []
        for n in p.survivors:
            first = next(r for r in cl.members[n].log.steps if r["epoch"] >= p.epoch_after)
            ends.append(first["t1"])
        if p.link is not None:
            until = prims[i + 1].t_req if i + 1 < len(prims) else float("inf")
            pair = frozenset(p.link)
            p.t_probed = max((t for t, ab in probes if ab == pair and p.t_req <= t < until),
                             default=0.0)  # fmt: skip
            ends.append(p.t_probed)
        p.t_settled = max(ends)
        cl.windows.append((p.t_req, p.t_settled))


def _quiet_steps(cl: _Cluster) -> dict[str, dict[int, float]]:
    """Per member, the durations of its steps outside every window, under an unchanged epoch,
    by step number."""
    out: dict[str, dict[int, float]] = {}
    for nid, m in cl.members.items():
        prev_epoch = None
        mine = out.setdefault(nid, {})
        for r in m.log.steps:
            quiet = r["epoch"] == prev_epoch and not any(
                r["t1"] > a and r["t0"] < b for a, b in cl.windows
            )
            if quiet:
                mine[int(r["step"])] = r["t1"] - r["t0"]
            prev_epoch = r["epoch"]
    return out


@dataclass
class _Tally:
    """What every attempt (one cluster each) has measured so far."""

    stalls: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in PRIMITIVES})
    nulls: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in PRIMITIVES})
    control: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in PRIMITIVES})
    baseline: list[float] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    reruns: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PRIMITIVES, 0))
    probed: int = 0
    """Connect-links whose bandwidth probe's end was found in the daemons' event logs."""


@dataclass
class _Doing:
    """What an attempt is doing, and since when (wall clock), for its failure report."""

    what: str
    since: float = field(default_factory=time.time)

    def start(self, what: str) -> None:
        self.what, self.since = what, time.time()


def _attempt(
    cl: _Cluster,
    nodes: int,
    repeats: int,
    settle_steps: int,
    tally: _Tally,
    echo: Callable[[str], None],
) -> None:
    """Runs rounds on a fresh cluster until every primitive has ``repeats`` samples.

    A worker that crashes, or training that does not resume after a primitive within the
    timeout, ends the attempt: the failure is recorded and the samples measured before it kept.
    """
    prims: list[Primitive] = []
    doing = _Doing("startup")

    def missing() -> bool:
        return any(
            len(tally.stalls[k]) + sum(p.kind == k for p in prims) < repeats for k in PRIMITIVES
        )

    try:
        cl.start("n1", None)
        cl.wait(lambda: bool(cl.members["n1"].last()), "n1 to train")
        cl.windows.append((doing.since, time.time()))
        for i in range(2, nodes + 1):
            cl.join(f"n{i}", "n1", settle_steps)
        echo(f"{nodes} trainers up; measuring ...")
        r = 0
        while missing():
            _round(cl, r, settle_steps, prims, doing)
            r += 1
            if missing():
                doing.start("rejoin")
                cl.join(f"j{r}", "n1", settle_steps)
            echo(f"round {r} done")
    except ChaosError as exc:
        first = str(exc).strip().splitlines()[0][:300]
        tally.failures.append({"during": doing.what, "error": first})
        cl.windows.append((doing.since, float("inf")))
        echo(f"FAILED during {doing.what}: {first}")
    finally:
        cl.close()
    _score(cl, prims, tally)


def _round(cl: _Cluster, r: int, settle_steps: int, prims: list[Primitive], doing: _Doing) -> None:
    """One round: connect-link and disconnect-link of two non-founder members, then scale-in
    of the newest member. ``doing`` is updated before each primitive (for failure reports)."""
    others = sorted(n for n in cl.live() if n != "n1")
    a, b = others[r % len(others)], others[(r + 1) % len(others)]
    doing.start("connect_link")
    prims.append(_link(cl, a, b, True, settle_steps))
    doing.start("disconnect_link")
    prims.append(_link(cl, a, b, False, settle_steps))
    doing.start("scale_in")
    leaver = max(others, key=list(cl.members).index)  # the newest member
    prims.append(_scale_in(cl, leaver, settle_steps))


def _score(cl: _Cluster, prims: list[Primitive], tally: _Tally) -> None:
    """Adds an attempt's samples to ``tally``: each primitive's stall, its placebo draws, its
    control path and reruns, and the attempt's undisturbed steps (the baseline)."""
    for m in cl.members.values():
        m.log.poll()
    _mark_windows(cl, prims, _probe_ends(cl.root))
    tally.probed += sum(1 for p in prims if p.t_probed > 0)
    quiet = _quiet_steps(cl)
    durations = [d for steps in quiet.values() for d in steps.values()]
    tally.baseline += durations
    if prims and not durations:
        raise ChaosError("no undisturbed step to take the baseline from")
    baseline_s = statistics.median(durations) if durations else 0.0
    for i, p in enumerate(prims):
        stall, spans = _stall_s(cl, p, baseline_s)
        tally.stalls[p.kind].append(stall)
        picks = [7919 * i + 104729 * j for j in range(NULL_DRAWS)]
        tally.nulls[p.kind] += null_stalls_s(quiet, spans, baseline_s, picks)
        tally.control[p.kind].append(p.control_s)
        tally.reruns[p.kind] += _reruns(cl, p)


@dataclass(frozen=True)
class PrimitivesConfig:
    """What one ``chaos-bench primitives`` run measures, and how (the CLI's options, one to one).

    Args:
        nodes: Trainer processes (at least 3: the link primitives need two non-founder members).
        repeats: Samples of each primitive. More samples narrow the p50; one run's
            ``added_p50_ms`` still moves by a millisecond or two on a shared host, so pool runs.
        compute_s: Per-step compute stand-in of each worker, seconds.
        width: Width of the workers' MLP.
        settle_steps: Steps under a new policy before the next primitive (at least 2).
        timeout_s: Longest wait for any one stage.
        max_failures: Failed attempts after which the bench stops with what it has.
        logs: Keep the workers' step logs and outputs here (default: a temporary directory).
        policy_notices: The trainers' ``TrainerConfig.policy_notices`` (``False``: they ask
            their daemon at every step boundary).
        daemon_config: A TOML file of ``DaemonConfig`` fields for every embedded daemon
            (e.g. ``bandwidth_probe_bytes = 65536``, to compare settings side by side).

    Raises:
        ConfigError: a value out of range (see each argument).
    """

    nodes: int = 4
    repeats: int = 10
    compute_s: float = 0.02
    width: int = 256
    settle_steps: int = 10
    timeout_s: float = 120.0
    max_failures: int = 3
    logs: Path | None = None
    policy_notices: bool = True
    daemon_config: Path | None = None

    def __post_init__(self) -> None:
        if self.nodes < 3:
            raise ConfigError(f"the link primitives need at least 3 nodes, got {self.nodes}")
        if self.repeats < 1 or self.width < 1 or self.max_failures < 1:
            raise ConfigError("repeats, width and max_failures must be at least 1")
        if self.settle_steps < 2:
            raise ConfigError(f"settle_steps must be at least 2, got {self.settle_steps}")
        if not (math.isfinite(self.compute_s) and self.compute_s >= 0):
            raise ConfigError(f"compute_s must be a finite number >= 0, got {self.compute_s}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError(f"timeout_s must be a finite number > 0, got {self.timeout_s}")

    def worker_args(self) -> list[str]:
        """The arguments every worker process gets (besides its id, address and log)."""
        args = ["--compute-s", str(self.compute_s), "--width", str(self.width)]
        args += ["--step-timeout-s", str(WORKER_STEP_TIMEOUT_S)]
        args += ["--policy-timeout-s", str(WORKER_POLICY_TIMEOUT_S)]
        args += [] if self.policy_notices else ["--no-policy-notices"]
        if self.daemon_config is not None:
            args.append(f"--daemon-arg=--config={self.daemon_config.resolve()}")
        return args


def run(cfg: PrimitivesConfig, echo: Callable[[str], None]) -> dict[str, Any]:
    """Runs the benchmark and returns its figures (see the module docstring).

    Each attempt starts a fresh cluster. When a primitive leaves the cluster unable to train
    (a member crashed, or no step completed under the new policy within the timeouts), the
    failure is recorded under ``"failures"`` and a new attempt starts, until every primitive has
    ``cfg.repeats`` samples or ``cfg.max_failures`` attempts failed.

    Args:
        cfg: What to measure.
        echo: Prints a progress line.

    Returns:
        The figures, as the JSON file holds them.

    Raises:
        ChaosError: some primitive has no sample at all.
    """
    tally = _Tally()
    attempt = 0
    with contextlib.ExitStack() as stack:
        if cfg.logs is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="chaos-prim-")))
        else:
            root = cfg.logs
        while any(len(tally.stalls[k]) < cfg.repeats for k in PRIMITIVES):
            if len(tally.failures) >= cfg.max_failures:
                echo(f"stopping after {len(tally.failures)} failed attempts")
                break
            attempt += 1
            (root / f"attempt{attempt}").mkdir(parents=True, exist_ok=True)
            cl = _Cluster(root / f"attempt{attempt}", cfg.worker_args(), cfg.timeout_s)
            _attempt(cl, cfg.nodes, cfg.repeats, cfg.settle_steps, tally, echo)
    empty = [k for k in PRIMITIVES if not tally.stalls[k]]
    if empty:
        raise ChaosError(f"no sample of {', '.join(empty)}; failures: {tally.failures}")
    return _figures(cfg, tally, attempt)


def _figures(cfg: PrimitivesConfig, tally: _Tally, attempts: int) -> dict[str, Any]:
    """The JSON figures of a run (see the module docstring) from what its attempts measured."""
    result: dict[str, Any] = {"nodes": cfg.nodes, "repeats": cfg.repeats,
                              "compute_s": cfg.compute_s,
                              "policy_notices": cfg.policy_notices}  # fmt: skip
    if cfg.daemon_config is not None:
        result["daemon_config"] = cfg.daemon_config.read_text()
    for kind in PRIMITIVES:
        result[f"{kind}_ms"] = summary_ms(tally.stalls[kind])
    result["null_ms"] = {kind: summary_ms(tally.nulls[kind]) for kind in PRIMITIVES}
    result["added_p50_ms"] = {
        kind: result[f"{kind}_ms"]["p50"] - result["null_ms"][kind]["p50"] for kind in PRIMITIVES
    }
    result["baseline_step_ms"] = statistics.median(tally.baseline) * 1e3
    result["baseline_step_p10_ms"] = percentile(tally.baseline, 10) * 1e3
    result["baseline_step_p90_ms"] = percentile(tally.baseline, 90) * 1e3
    result["baseline_steps"] = len(tally.baseline)
    result["control_ms"] = {kind: summary_ms(tally.control[kind]) for kind in PRIMITIVES}
    result["reruns"] = tally.reruns
    result["probes_measured"] = tally.probed
    result["attempts"] = attempts
    result["failures"] = tally.failures
    return result


@click.command("primitives")
@click.option(
    "--nodes", type=click.IntRange(3, 16), default=PrimitivesConfig.nodes, show_default=True
)
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False), required=True, help="Write here."
)
@click.option(
    "--repeats",
    type=click.IntRange(1),
    default=PrimitivesConfig.repeats,
    show_default=True,
    help="Samples of each primitive (each round also re-adds the node that left).",
)
@click.option(
    "--compute-s",
    type=click.FloatRange(0.0),
    default=PrimitivesConfig.compute_s,
    show_default=True,
    help="Gradient computation per step, besides a small real forward/backward (seconds).",
)
@click.option(
    "--width",
    type=click.IntRange(1),
    default=PrimitivesConfig.width,
    show_default=True,
    help="MLP width.",
)
@click.option(
    "--settle-steps",
    type=click.IntRange(2),
    default=PrimitivesConfig.settle_steps,
    show_default=True,
    help="Steps every member runs under a new policy before the next primitive.",
)
@click.option(
    "--timeout-s",
    type=click.FloatRange(1.0),
    default=PrimitivesConfig.timeout_s,
    show_default=True,
    help="Per stage.",
)
@click.option(
    "--max-failures",
    type=click.IntRange(1),
    default=PrimitivesConfig.max_failures,
    show_default=True,
    help="Failed attempts (training did not resume after a primitive) before giving up.",
)
@click.option(
    "--logs",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep the workers' step logs (JSONL) and outputs in this directory.",
)
@click.option(
    "--policy-notices/--no-policy-notices",
    default=True,
    show_default=True,
    help="Trainers learn of new policies from their daemon's notices (off: ask every step).",
)
@click.option(
    "--daemon-config",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="TOML file of DaemonConfig fields for every embedded daemon (copied into the JSON).",
)
def primitives_command(
    nodes: int,
    json_path: str,
    repeats: int,
    compute_s: float,
    width: int,
    settle_steps: int,
    timeout_s: float,
    max_failures: int,
    logs: Path | None,
    policy_notices: bool,
    daemon_config: Path | None,
) -> None:
    """Training-step stall of scale-in, connect-link and disconnect-link (real trainers)."""
    try:
        cfg = PrimitivesConfig(
            nodes, repeats, compute_s, width, settle_steps, timeout_s, max_failures, logs,
            policy_notices, daemon_config,
        )  # fmt: skip
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    with LiveProgress("primitives") as live:
        result = run(cfg, live)
    Path(json_path).write_text(json.dumps(result, indent=2))
    head = f"{'primitive':<17}{'stall p50 ms':>13}{'stall p99 ms':>13}{'null p50 ms':>12}"
    click.echo(f"{head}{'added p50 ms':>13}{'control p50 ms':>15}{'reruns':>8}{'n':>4}")
    for kind in PRIMITIVES:
        s, c = result[f"{kind}_ms"], result["control_ms"][kind]
        z, added = result["null_ms"][kind], result["added_p50_ms"][kind]
        row = f"{kind:<17}{s['p50']:>13.3f}{s['p99']:>13.3f}{z['p50']:>12.3f}{added:>13.3f}"
        click.echo(f"{row}{c['p50']:>15.3f}{result['reruns'][kind]:>8}{s['n']:>4}")
    click.echo(
        "null: the same estimator on undisturbed steps (the worst member's noise); "
        "added = stall p50 - null p50"
    )
    click.echo(
        f"baseline step: {result['baseline_step_ms']:.3f} ms, median of "
        f"{result['baseline_steps']} undisturbed steps (p10 {result['baseline_step_p10_ms']:.3f}, "
        f"p90 {result['baseline_step_p90_ms']:.3f})"
    )
    for f in result["failures"]:
        click.echo(f"failed attempt, during {f['during']}: {f['error']}")
    click.echo(f"wrote {json_path}")
