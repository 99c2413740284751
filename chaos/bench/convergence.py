"""``chaos-bench convergence``: accuracy over steps and time, static clusters against scale-out.

The paper's convergence figures: a real model (a small MLP) trains on real data (scikit-learn's
bundled digits) in a loopback cluster of real training processes, each with its embedded
daemon, under four kinds of run:

- ``static-N`` and ``static-N+1``: ``--devices`` devices, and one more, from step 0 to the end;
- ``scale-out``: ``N`` devices, one more joins at 40 % of the steps;
- ``churn``: ``N`` devices; a join at 20 %, a graceful leave at 40 %, a join at 60 % and a
  ``kill -9`` of a worker (not the founder) at 80 %.

Each kind is run with two batch modes: ``constant`` (``TrainerConfig.global_batch``: the
scheduler splits ``--global-batch`` samples a step across the members, each uses
``trainer.local_batch_size``) and ``per-device`` (every device uses ``global_batch / N``
samples, so the global batch changes with the membership), ``--seeds`` seeds each, all for
``--steps`` steps. The founder, which is never killed, evaluates the shared model on a held-out
split every ``--eval-every`` steps. Scripted membership changes are triggered by the founder's
step records, never by sleeping.

Reported: every run's series (step, seconds, loss, accuracy, members); per batch mode the
static runs' spread (min..max of final accuracy and loss over both static kinds and all seeds);
per run kind the medians of the final figures and whether they lie inside that spread. The goal
checked: with the constant global batch, every kind with membership changes ends inside it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

from chaos.bench.hetero import DAEMON_ARGS
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

SKLEARN_HINT = (
    "chaos-bench convergence trains on scikit-learn's bundled digits: "
    "pip install 'chaos-edge[examples]'"
)
BATCH_MODES = ("constant", "per-device")
CHANGE_KINDS = ("scale-out", "churn")
SCALE_OUT_AT = 0.4
"""The join of a scale-out run, as a fraction of the steps."""
CHURN = (("join", 0.2), ("leave", 0.4), ("join", 0.6), ("kill", 0.8))
"""A churn run's membership changes, each at a fraction of the steps."""
WORKER_MODULE = "chaos.bench.convergence_worker"
LAUNCHER_MARGIN_S = 30.0
"""How much longer than a worker's own waits the launcher waits, so that a worker that gives
up first reports why (its last output line becomes the run's error)."""


def static_kinds(devices: int) -> tuple[str, str]:
    """The two static kinds for ``devices``: ``static-N`` and ``static-N+1``."""
    return f"static-{devices}", f"static-{devices + 1}"


@dataclass(frozen=True)
class ConvergenceConfig:
    """One benchmark's settings.

    Args:
        devices: Devices of the smaller static cluster and of a run's start (2-7).
        global_batch: Samples per step over the cluster in ``constant`` mode; ``per-device``
            gives each device ``global_batch / devices``, so it must divide evenly.
        seeds: Seeds per run kind and batch mode (``0 .. seeds-1``).
        steps: Optimizer steps of every run. Raise it for a longer curve.
        eval_every: Steps between two evaluations on the test split.
        lr: The SGD learning rate (momentum 0.9).
        sample_s: Each device's compute per sample, in seconds (a sleep beside the model's own
            work), so that a step's time grows with its samples as on a real device.
        kinds: Run kinds to make (default: all four).
        batch_modes: Batch modes to make (default: both).
        timeout_s: The limit on each wait of a worker (its start, its join, a stalled step);
            the launcher allows ``LAUNCHER_MARGIN_S`` more for each of its own waits.
        work_dir: Where the workers' logs, step records and daemons' logs go (default: a
            temporary directory).

    Raises:
        ConfigError: a value out of range, or an unknown kind or batch mode.
    """

    devices: int = 4
    global_batch: int = 32
    seeds: int = 3
    steps: int = 300
    eval_every: int = 10
    lr: float = 0.05
    sample_s: float = 0.005
    kinds: tuple[str, ...] = ()
    batch_modes: tuple[str, ...] = BATCH_MODES
    timeout_s: float = 120.0
    work_dir: Path | None = None

    def __post_init__(self) -> None:
        if not 2 <= self.devices <= 7:
            raise ConfigError(f"devices must be 2-7, got {self.devices}")
        if self.global_batch < self.devices + 1 or self.global_batch % self.devices:
            raise ConfigError(f"global_batch ({self.global_batch}) must be a multiple of "
                              f"devices ({self.devices}) and above it")  # fmt: skip
        if not 1 <= self.seeds <= 20:
            raise ConfigError(f"seeds must be 1-20, got {self.seeds}")
        if self.steps < 10 or not 1 <= self.eval_every <= self.steps:
            raise ConfigError(f"steps ({self.steps}) must be >= 10 and eval_every "
                              f"({self.eval_every}) in 1..steps")  # fmt: skip
        if not self.lr > 0 or not self.sample_s >= 0 or not self.timeout_s > 0:
            raise ConfigError("lr and timeout_s must be positive, sample_s >= 0")
        if not self.kinds:
            object.__setattr__(self, "kinds", (*static_kinds(self.devices), *CHANGE_KINDS))
        allowed = (*static_kinds(self.devices), *CHANGE_KINDS)
        bad = [k for k in self.kinds if k not in allowed]
        if bad or len(set(self.kinds)) != len(self.kinds):
            raise ConfigError(f"kinds must be distinct, of {', '.join(allowed)}; got {self.kinds}")
        bad = [m for m in self.batch_modes if m not in BATCH_MODES]
        if bad or not self.batch_modes or len(set(self.batch_modes)) != len(self.batch_modes):
            raise ConfigError(f"batch_modes must be distinct, of {', '.join(BATCH_MODES)}; "
                              f"got {self.batch_modes}")  # fmt: skip


@dataclass(frozen=True)
class _Change:
    """A scripted membership change: ``action`` of ``node`` once the founder reaches ``at``."""

    action: str
    node: str
    at: int
    members_after: int


def schedule(cfg: ConvergenceConfig, kind: str) -> tuple[int, list[_Change]]:
    """The first membership and the scripted changes of a run kind.

    Args:
        cfg: The settings.
        kind: A run kind of ``cfg``.

    Returns:
        ``(initial members, changes)``; members are ``n0``, ``n1``, ...; ``n0`` founds.
    """
    n = cfg.devices
    if kind in static_kinds(n):
        return int(kind.split("-")[1]), []
    if kind == "scale-out":
        return n, [_Change("join", f"n{n}", round(cfg.steps * SCALE_OUT_AT), n + 1)]
    changes, alive, joined = [], [f"n{k}" for k in range(n)], n
    for action, frac in CHURN:
        if action == "join":
            node, joined = f"n{joined}", joined + 1
            alive.append(node)
        else:  # a leave or a kill: the oldest member after the founder
            node = alive.pop(1)
        changes.append(_Change(action, node, round(cfg.steps * frac), len(alive)))
    return n, changes


# ----------------------------------------------------------------------------- one run


class _Records:
    """The JSON lines a worker appends to its ``--out`` file, read as they come."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.items: list[dict[str, Any]] = []
        self._pos = 0
        self._partial = b""

    def poll(self) -> list[dict[str, Any]]:
        if self.path.exists():
            with self.path.open("rb") as f:
                f.seek(self._pos)
                chunk = f.read()
                self._pos = f.tell()
            *lines, self._partial = (self._partial + chunk).split(b"\n")
            self.items += [json.loads(line) for line in lines if line.strip()]
        return self.items

    def has(self, kind: str) -> bool:
        return any(r.get("kind") == kind for r in self.poll())

    def last_step(self) -> dict[str, Any]:
        steps = [r for r in self.poll()[-50:] if "members" in r]
        return steps[-1] if steps else {}


@dataclass
class _Worker:
    id: str
    proc: Any
    out: _Records
    log: Path
    go: Path | None


class _Run:
    """One run's workers: started together, joined by go files, reaped on close."""

    def __init__(self, cfg: ConvergenceConfig, mode: str, seed: int, root: Path) -> None:
        self.cfg, self.mode, self.seed, self.root = cfg, mode, seed, root
        self.workers: dict[str, _Worker] = {}
        self.watched: dict[str, _Worker] = {}
        self.founder_address = free_tcp_address()
        # the daemons' sockets: a short path (an IPC path is at most 107 bytes), not root
        self._sockets = tempfile.TemporaryDirectory(prefix="chaos-cv-")

    def spawn(self, nid: str, initial: int) -> _Worker:
        cfg, founder = self.cfg, not self.workers
        out, log = self.root / f"{nid}.jsonl", self.root / f"{nid}.log"
        go = None if founder else self.root / f"{nid}.go"
        address = self.founder_address if founder else free_tcp_address()
        argv = [sys.executable, "-m", WORKER_MODULE, "--id", nid, "--listen", address]
        argv += ["--out", str(out), "--seed", str(self.seed), "--steps", str(cfg.steps)]
        argv += ["--eval-every", str(cfg.eval_every), "--lr", repr(cfg.lr)]
        argv += ["--sample-time", repr(cfg.sample_s), "--timeout", repr(cfg.timeout_s)]
        # a joiner waits for its go file through the start and every step before its join
        argv += ["--go-timeout", repr(cfg.timeout_s * (cfg.steps + 10))]
        if self.mode == "constant":
            argv += ["--global-batch", str(cfg.global_batch)]
        else:
            argv += ["--local-batch", str(cfg.global_batch // cfg.devices)]
        argv += [f"--daemon-arg={a}" for a in DAEMON_ARGS]
        argv += ["--initial", str(initial)] if initial > 1 else []
        argv += ["--evaluate"] if founder else ["--join", self.founder_address, "--go", str(go)]
        env = {"TMPDIR": self._sockets.name, LOG_LEVEL_ENV: "WARNING"}
        proc = spawn_worker(argv, log_path=log, env=env, append=False, term_on_parent_death=True)
        worker = _Worker(nid, proc, _Records(out), log, go)
        self.workers[nid] = self.watched[nid] = worker
        return worker

    @property
    def founder(self) -> _Worker:
        return self.workers["n0"]

    def wait(self, pred: Callable[[], object], what: str) -> None:
        procs = {nid: w.proc for nid, w in self.watched.items()}
        try:
            timeout_s = self.cfg.timeout_s + LAUNCHER_MARGIN_S
            wait_until(pred, timeout_s, what, poll_s=0.05, watch=procs)
        except ProcessExited as exc:
            text = self.workers[exc.name].log.read_text(errors="replace").strip().splitlines()
            raise ChaosError(f"worker {exc.name} exited ({exc.code}) while waiting for {what}: "
                             f"{text[-1] if text else 'no output'}") from exc  # fmt: skip

    def step(self) -> int:
        return int(self.founder.out.last_step().get("step", 0))

    def members(self) -> int:
        return int(self.founder.out.last_step().get("members", 0))

    def wait_step(self, target: int, what: str) -> None:
        """Waits for the founder's step ``target``, allowing ``timeout_s`` per step."""
        while (now := self.step()) < target:
            self.wait(functools.partial(self.step_beyond, now), f"{what} (step {now} -> {now + 1})")

    def step_beyond(self, step: int) -> bool:
        return self.step() > step

    def wait_members(self, size: int, what: str) -> None:
        """Waits for the founder's steps to run with ``size`` members (``what`` landed).

        Raises:
            ChaosError: the founder finished its steps first (a change too late in the run).
        """

        def landed() -> bool:
            if self.founder.out.has("done"):
                raise ChaosError(f"the run ended at step {self.step()} before {what} landed")
            return self.members() == size

        self.wait(landed, f"{size} members after {what}")

    def close(self) -> None:
        try:
            kill_and_reap([w.proc for w in self.workers.values()], group=True)
            with contextlib.suppress(OSError):  # the daemons' logs and events, beside the rest
                skip = shutil.ignore_patterns("*.ipc", "torchinductor_*")
                shutil.copytree(self._sockets.name, self.root / "daemons", ignore=skip)
        finally:
            self._sockets.cleanup()


def _start(run: _Run, initial: int, changes: list[_Change]) -> None:
    """Starts every worker at once; joins the first members one at a time; waits for step 1."""
    for k in range(initial):
        run.spawn(f"n{k}", initial)
    for c in changes:
        if c.action == "join":
            run.spawn(c.node, 1)
    run.wait(lambda: run.founder.out.has("ready"), "the founder to start")
    for k in range(1, initial):
        w = run.workers[f"n{k}"]
        if w.go is not None:
            w.go.touch()
        run.wait(functools.partial(w.out.has, "ready"), f"{w.id} to join")
    run.wait(lambda: run.step() >= 1, f"the first step with {initial} members")


def _apply(run: _Run, change: _Change) -> dict[str, Any]:
    """Makes one scripted change at its step; waits until the founder sees its membership."""
    run.wait_step(change.at, f"step {change.at} for the {change.action} of {change.node}")
    w = run.workers[change.node]
    issued = run.step()
    if change.action == "join" and w.go is not None:
        w.go.touch()
    elif change.action == "leave":
        run.watched.pop(w.id)
        w.proc.send_signal(signal.SIGTERM)  # the worker leaves gracefully at its next step
    elif change.action == "kill":
        run.watched.pop(w.id)
        kill_and_reap([w.proc], group=True)  # kill -9 of the worker and its daemon
    run.wait_members(change.members_after, f"the {change.action} of {change.node}")
    return {"action": change.action, "node": change.node, "at_step": change.at,
            "issued_step": issued, "effective_step": run.step()}  # fmt: skip


def run_one(cfg: ConvergenceConfig, kind: str, mode: str, seed: int, root: Path) -> dict[str, Any]:
    """One run: its series and its scripted changes, or the reason it failed.

    Returns:
        ``kind``, ``batch_mode``, ``seed``, ``ok``, ``series`` (step, wall_s, loss, accuracy,
        members), ``changes``, ``final`` (the last evaluation) and ``error`` (``None`` if ok).
    """
    root.mkdir(parents=True, exist_ok=True)
    initial, changes = schedule(cfg, kind)
    result: dict[str, Any] = {"kind": kind, "batch_mode": mode, "seed": seed, "ok": False,
                              "series": [], "changes": [], "final": None,
                              "error": None}  # fmt: skip
    t0 = time.monotonic()
    with contextlib.closing(_Run(cfg, mode, seed, root)) as run:
        try:
            _start(run, initial, changes)
            for change in changes:
                result["changes"].append(_apply(run, change))
            run.wait_step(cfg.steps, f"step {cfg.steps}")
            run.wait(lambda: run.founder.out.has("done"), "the founder to finish")
        except (ChaosError, OSError, ValueError) as exc:  # ChaosTimeout is a ChaosError
            result["error"] = f"{type(exc).__name__}: {exc}"
        records = run.founder.out.poll()
    keys = ("step", "wall_s", "loss", "accuracy", "members")
    result["series"] = [{k: r[k] for k in keys} for r in records if "accuracy" in r]
    result["run_s"] = time.monotonic() - t0
    if result["error"] is None:
        result["ok"] = True
        result["final"] = result["series"][-1]
    return result


# ----------------------------------------------------------------------------- the summary


def _median(values: list[float]) -> float:
    return statistics.median(values)


def summarize(runs: list[dict[str, Any]], devices: int) -> dict[str, Any]:
    """The static spread, the medians per run kind and the verdicts, per batch mode.

    Args:
        runs: :func:`run_one`'s results.
        devices: The config's devices (names the static kinds).

    Returns:
        Per batch mode: ``spread`` (``accuracy`` and ``loss`` as ``[min, max]`` over the
        static runs' final figures; ``None`` without a static run) and ``kinds``: per kind
        ``runs``, ``failed``, ``accuracy_median``, ``loss_median``, ``wall_s_median``,
        ``seeds_inside`` and ``inside`` (its medians inside the spread; ``None`` when there is
        no spread or no successful run); and ``goal``: whether every kind with membership
        changes is inside in ``constant`` mode (``None`` if that cannot be judged).
    """
    statics = static_kinds(devices)
    out: dict[str, Any] = {}
    for mode in BATCH_MODES:
        mine = [r for r in runs if r["batch_mode"] == mode]
        if not mine:
            continue
        finals = [r["final"] for r in mine if r["ok"] and r["kind"] in statics]
        spread = None
        if finals:
            spread = {m: [min(f[m] for f in finals), max(f[m] for f in finals)]
                      for m in ("accuracy", "loss")}  # fmt: skip

        def inside(fig: dict[str, float], spread: dict[str, list[float]] | None = spread) -> bool:
            return spread is not None and all(
                spread[m][0] <= fig[m] <= spread[m][1] for m in ("accuracy", "loss")
            )

        kinds: dict[str, Any] = {}
        for kind in dict.fromkeys(r["kind"] for r in mine):
            ok = [r["final"] for r in mine if r["kind"] == kind and r["ok"]]
            row: dict[str, Any] = {"runs": len(ok), "failed": sum(
                1 for r in mine if r["kind"] == kind and not r["ok"])}  # fmt: skip
            if ok:
                med = {m: _median([f[m] for f in ok]) for m in ("accuracy", "loss", "wall_s")}
                row.update({f"{m}_median": v for m, v in med.items()})
                row["seeds_inside"] = sum(inside(f) for f in ok)
                row["inside"] = inside(med) if spread is not None else None
            else:
                row["inside"] = None
            kinds[kind] = row
        out[mode] = {"spread": spread, "kinds": kinds}
    changed = [row for k, row in out.get("constant", {}).get("kinds", {}).items()
               if k in CHANGE_KINDS]  # fmt: skip
    verdicts = [row["inside"] for row in changed]
    goal = None if not verdicts or None in verdicts else all(verdicts)
    return {"by_mode": out, "goal": goal}


# ----------------------------------------------------------------------------- the benchmark


def run(cfg: ConvergenceConfig, echo: Callable[[str], None]) -> dict[str, Any]:
    """Makes every run (seed by seed, so that the load falls alike on every kind).

    Returns:
        ``config``, ``static_kinds`` (the spread's kinds), ``runs`` (each :func:`run_one`'s
        result) and ``summary`` (:func:`summarize`).
    """
    runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        root = cfg.work_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        for seed in range(cfg.seeds):
            for mode in cfg.batch_modes:
                for kind in cfg.kinds:
                    r = run_one(cfg, kind, mode, seed, root / f"{kind}-{mode}-{seed}")
                    runs.append(r)
                    echo(_run_line(r))
    conf = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    return {"config": conf, "static_kinds": list(static_kinds(cfg.devices)), "runs": runs,
            "summary": summarize(runs, cfg.devices)}  # fmt: skip


def _run_line(r: dict[str, Any]) -> str:
    head = f"{r['kind']:>10} {r['batch_mode']:>10} seed {r['seed']}: "
    if not r["ok"]:
        return head + f"FAILED after {r['run_s']:.0f} s: {r['error']}"
    f, changes = r["final"], " ".join(f"{c['action']}@{c['effective_step']}" for c in r["changes"])
    return head + (f"accuracy {f['accuracy']:.3f} loss {f['loss']:.3f} in {f['wall_s']:.1f} s "
                   f"({r['run_s']:.0f} s with start) {changes}")  # fmt: skip


def report(result: dict[str, Any]) -> list[str]:
    """The summary as printed lines: a table per batch mode, the spread, the verdicts."""
    lines: list[str] = []
    summary = result["summary"]
    for mode, s in summary["by_mode"].items():
        lines.append(f"{mode} batch:")
        lines.append(f"{'run':>12}{'runs':>6}{'acc median':>12}{'loss median':>13}"
                     f"{'wall s':>8}  inside spread")  # fmt: skip
        for kind, row in s["kinds"].items():
            if not row["runs"]:
                lines.append(f"{kind:>12}{'0':>6}  all {row['failed']} failed")
                continue
            verdict = {True: "yes", False: "NO", None: "n/a"}[row["inside"]]
            lines.append(f"{kind:>12}{row['runs']:>6}{row['accuracy_median']:>12.4f}"
                         f"{row['loss_median']:>13.4f}{row['wall_s_median']:>8.1f}  {verdict} "
                         f"({row['seeds_inside']}/{row['runs']} seeds)")  # fmt: skip
        sp = s["spread"]
        if sp is not None:
            acc, loss = sp["accuracy"], sp["loss"]
            lines.append(f"  static spread: accuracy {acc[0]:.4f}..{acc[1]:.4f}, "
                         f"loss {loss[0]:.4f}..{loss[1]:.4f}")  # fmt: skip
    goal = {True: "met", False: "NOT met", None: "not judged"}[summary["goal"]]
    lines.append(f"goal (constant global batch: every run with membership changes inside the "
                 f"static spread): {goal}")  # fmt: skip
    return lines


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


@click.command("convergence")
@click.option("--devices", type=click.IntRange(2, 7), default=ConvergenceConfig.devices,
              show_default=True, help="Devices of the smaller static cluster.")  # fmt: skip
@click.option("--global-batch", type=click.IntRange(3), default=ConvergenceConfig.global_batch,
              show_default=True)  # fmt: skip
@click.option("--seeds", type=click.IntRange(1, 20), default=ConvergenceConfig.seeds,
              show_default=True, help="Seeds per run kind and batch mode.")  # fmt: skip
@click.option("--steps", type=click.IntRange(10), default=ConvergenceConfig.steps,
              show_default=True)  # fmt: skip
@click.option("--eval-every", type=click.IntRange(1), default=ConvergenceConfig.eval_every,
              show_default=True)  # fmt: skip
@click.option("--lr", type=click.FloatRange(0.0, min_open=True), default=ConvergenceConfig.lr,
              show_default=True)  # fmt: skip
@click.option("--sample-time", "sample_s", type=click.FloatRange(0.0),
              default=ConvergenceConfig.sample_s, show_default=True,
              help="Seconds of compute per sample on every device.")  # fmt: skip
@click.option("--kinds", default="", help="Comma list (default: static-N, static-N+1, "
              "scale-out, churn).")  # fmt: skip
@click.option("--batch-modes", default=",".join(BATCH_MODES), show_default=True)
@click.option("--timeout", "timeout_s", type=click.FloatRange(1.0),
              default=ConvergenceConfig.timeout_s, show_default=True,
              help="Seconds allowed per wait of a run.")  # fmt: skip
@click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the workers' logs here.")  # fmt: skip
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              required=True, help="Write the result here.")  # fmt: skip
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False, path_type=Path),
              default=None, help="Write the PNGs here.")  # fmt: skip
def convergence_command(
    devices: int, global_batch: int, seeds: int, steps: int, eval_every: int, lr: float,
    sample_s: float, kinds: str, batch_modes: str, timeout_s: float, work_dir: Path | None,
    json_path: Path, plot_dir: Path | None,
) -> None:  # fmt: skip
    """Accuracy over steps and time: static clusters against scale-out and churn."""
    try:
        cfg = ConvergenceConfig(devices, global_batch, seeds, steps, eval_every, lr, sample_s,
                                _names(kinds), _names(batch_modes), timeout_s,
                                work_dir)  # fmt: skip
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        import sklearn  # noqa: F401  (the workers load its bundled digits)
    except ImportError as exc:
        raise click.ClickException(SKLEARN_HINT) from exc
    total = cfg.seeds * len(cfg.batch_modes) * len(cfg.kinds)
    with LiveProgress("convergence", total, "runs") as live:
        result = run(cfg, live.done)
    for line in report(result):
        click.echo(line)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2))
    if plot_dir is not None:
        from chaos.bench.convergence_plot import plot_convergence

        for path in plot_convergence(result, plot_dir):
            click.echo(f"wrote {path}")
    failed = sum(not r["ok"] for r in result["runs"])
    if failed:
        raise click.ClickException(f"{failed} of {len(result['runs'])} runs failed (see the "
                                   f"JSON's 'error' fields)")  # fmt: skip


if __name__ == "__main__":
    convergence_command()
