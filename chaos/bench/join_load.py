"""``chaos-bench join-load``: two trainers join a founder at once on a CPU-starved machine.

Each run starts one busy-loop process per core (``while True: pass``), then a founder trainer
(a real :class:`chaos.trainer.Trainer` with its embedded daemon on loopback, a small MLP, a
plain ``update()`` loop), waits for its first step, then starts two joiner trainers at once
(``join=`` the founder's daemon endpoint). A run passes when both joiners take a step within
the deadline; otherwise it fails, with the exception text each joiner recorded.

The trainers run :mod:`chaos.bench.join_load_worker` by its file path under the interpreter
named by ``--python LABEL=PATH``, so the same benchmark measures another installed version of
the package (an older release in its own virtual environment) beside this one. With several
``--python`` the runs alternate between them (run 1 of each, run 2 of each, ...), so that every
version sees the same background load. Every process of a run (busy loops, trainers, their
embedded daemons) is killed when the run ends, whatever happened.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from chaos.launch import free_tcp_address
from chaos.progress import LiveProgress

WORKER = Path(__file__).with_name("join_load_worker.py")
"""The trainer script, run by its path so that it imports the chosen interpreter's ``chaos``."""
POLL_S = 0.1
"""How often the launcher reads the trainers' record files."""
KILL_WAIT_S = 10.0
"""How long the launcher waits for a killed process group's leader to be reaped."""
STACK_WAIT_S = 5.0
"""How long the launcher waits for a pending trainer to dump its threads' stacks."""
JOINERS = ("n1", "n2")
"""The joiners' node ids (the founder is ``n0``)."""


@dataclass(frozen=True)
class JoinLoadConfig:
    """One ``join-load`` measurement.

    Attributes:
        runs: Runs per interpreter.
        deadline_s: From the joiners' start, the longest a run waits for both to step.
        founder_timeout_s: The longest a run waits for the founder's first step.
        busy: Busy-loop processes per run (default: one per core).
        pythons: ``(label, interpreter)`` pairs; the runs alternate between them.
    """

    runs: int = 20
    deadline_s: float = 180.0
    founder_timeout_s: float = 180.0
    busy: int = field(default_factory=lambda: os.cpu_count() or 1)
    pythons: tuple[tuple[str, str], ...] = (("current", sys.executable),)

    def __post_init__(self) -> None:
        if self.runs < 1:
            raise ValueError(f"runs must be at least 1, got {self.runs}")
        if self.deadline_s <= 0 or self.founder_timeout_s <= 0:
            raise ValueError("deadline_s and founder_timeout_s must be positive")
        if self.busy < 0:
            raise ValueError(f"busy must be non-negative, got {self.busy}")
        labels = [label for label, _ in self.pythons]
        if not labels or len(set(labels)) != len(labels):
            raise ValueError(f"pythons needs distinct labels, got {labels}")


def _spin() -> None:  # pragma: no cover - runs in a busy-loop child until it is killed
    while True:
        pass


def read_records(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines a worker wrote so far (a partial last line is skipped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def outcome(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One trainer's state from its records: ``stepped`` and ``error`` (or ``None``), the
    seconds from its process start to ``ready`` and to its first step."""
    by_event = {r["event"]: r for r in records}
    return {
        "stepped": "stepped" in by_event,
        "error": by_event["error"]["error"] if "error" in by_event else None,
        "ready_s": by_event.get("ready", {}).get("elapsed_s"),
        "stepped_s": by_event.get("stepped", {}).get("elapsed_s"),
        "chaos": by_event.get("imported", {}).get("chaos"),
    }


def _settled(state: dict[str, Any]) -> bool:
    return bool(state["stepped"] or state["error"])


class _Run:
    """The processes of one run; :meth:`close` kills them all."""

    def __init__(self, python: str, work: Path) -> None:
        self.python = python
        self.work = work
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.busy: list[multiprocessing.context.ForkProcess] = []

    def start_busy(self, n: int) -> None:
        ctx = multiprocessing.get_context("fork")
        for _ in range(n):
            p = ctx.Process(target=_spin, daemon=True)
            p.start()
            self.busy.append(p)

    def start_trainer(self, node_id: str, listen: str, join: str | None) -> None:
        cmd = [self.python, "-P", str(WORKER), "--node-id", node_id, "--listen", listen,
               "--out", str(self.work / f"{node_id}.jsonl")]  # fmt: skip
        if join is not None:
            cmd += ["--join", join]
        with open(self.work / f"{node_id}.log", "wb") as log:
            # cwd: the run's own directory, as its embedded daemon's ``python -m`` puts the
            # working directory first on its path (a checkout there would shadow the package)
            self.procs[node_id] = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.work
            )

    def state(self, node_id: str) -> dict[str, Any]:
        st = outcome(read_records(self.work / f"{node_id}.jsonl"))
        proc = self.procs[node_id]
        if not _settled(st) and proc.poll() is not None:
            log = (self.work / f"{node_id}.log").read_text(errors="replace")[-2000:]
            st["error"] = f"exited with code {proc.returncode} before stepping: {log}"
        return st

    def wait(self, node_ids: tuple[str, ...], timeout_s: float) -> dict[str, dict[str, Any]]:
        """Polls until every trainer named stepped or failed, or ``timeout_s`` passed; a
        trainer still pending then gets a timeout error."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = {n: self.state(n) for n in node_ids}
            if all(_settled(s) for s in states.values()):
                return states
            if time.monotonic() >= deadline:
                for n, s in states.items():
                    if not _settled(s):
                        s["error"] = (f"no step within the run's deadline of {timeout_s} s; "
                                      f"where it was: {self._stacks(n)}")  # fmt: skip
                return states
            time.sleep(POLL_S)

    def _stacks(self, node_id: str) -> str:
        """A pending trainer's threads' stacks (the worker dumps them on SIGUSR1 into its log),
        the end of its log, for a failure's record."""
        log = self.work / f"{node_id}.log"
        size = log.stat().st_size if log.exists() else 0
        try:
            self.procs[node_id].send_signal(signal.SIGUSR1)
        except ProcessLookupError:
            return "it had exited"
        deadline = time.monotonic() + STACK_WAIT_S
        while time.monotonic() < deadline and (log.stat().st_size if log.exists() else 0) == size:
            time.sleep(POLL_S)
        return log.read_text(errors="replace")[-3000:] if log.exists() else "no log"

    def close(self) -> None:
        for proc in self.procs.values():  # the group holds the trainer and its daemon
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
        for p in self.busy:
            p.kill()
            p.join(timeout=KILL_WAIT_S)


def run_once(python: str, cfg: JoinLoadConfig, work: Path) -> dict[str, Any]:
    """One run: busy loops, a founder's first step, then two joiners at once.

    Returns:
        ``passed``, the founder's and each joiner's :func:`outcome`, the seconds from the
        joiners' start to both having stepped (``None`` when the run failed), and the
        machine's one-minute load average before the run (other work on the machine).
    """
    run = _Run(python, work)
    load = os.getloadavg()[0]  # the machine's load before this run's busy loops start
    try:
        run.start_busy(cfg.busy)
        founder_endpoint = free_tcp_address()
        run.start_trainer("n0", founder_endpoint, None)
        founder = run.wait(("n0",), cfg.founder_timeout_s)["n0"]
        if not founder["stepped"]:
            return {
                "passed": False,
                "founder": founder,
                "joiners": {},
                "join_s": None,
                "load_1min": load,
            }
        started = time.monotonic()
        for node_id in JOINERS:
            run.start_trainer(node_id, free_tcp_address(), founder_endpoint)
        joiners = run.wait(JOINERS, cfg.deadline_s)
        passed = all(j["stepped"] for j in joiners.values())
        join_s = round(time.monotonic() - started, 2) if passed else None
        return {
            "passed": passed,
            "founder": founder,
            "joiners": joiners,
            "join_s": join_s,
            "load_1min": load,
        }
    finally:
        run.close()


def measure(cfg: JoinLoadConfig, echo: Any = print) -> dict[str, Any]:
    """All runs, alternating between the interpreters; returns the JSON document."""
    results: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in cfg.pythons}
    with tempfile.TemporaryDirectory(prefix="chaos-join-load-") as tmp:
        for i in range(cfg.runs):
            for label, python in cfg.pythons:
                work = Path(tmp) / f"{label}-{i}"
                work.mkdir()
                r = run_once(python, cfg, work)
                results[label].append(r)
                errors = [j["error"] for j in r["joiners"].values() if j["error"]]
                if not r["founder"]["stepped"]:
                    errors.append(f"founder: {r['founder']['error']}")
                first = errors[0].splitlines()[0][:160] if errors else ""
                verdict = "pass" if r["passed"] else "FAIL"
                echo(f"{label:<10} run {i + 1:>3}/{cfg.runs}  {verdict}  join {r['join_s']} s  "
                     f"load {r['load_1min']:.1f}  {first}")  # fmt: skip
    return {
        "cores": os.cpu_count(),
        "busy_processes": cfg.busy,
        "deadline_s": cfg.deadline_s,
        "runs": cfg.runs,
        "variants": {label: _summary(python, results[label]) for label, python in cfg.pythons},
    }


def _summary(python: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    failures = [{"run": i + 1, "founder_error": r["founder"]["error"],
                 "errors": {n: j["error"] for n, j in r["joiners"].items() if j["error"]}}
                for i, r in enumerate(runs) if not r["passed"]]  # fmt: skip
    trainers = [t for r in runs for t in (r["founder"], *r["joiners"].values())]
    chaos_files = {t["chaos"] for t in trainers if t["chaos"]}
    return {
        "python": python,
        "chaos": sorted(chaos_files),
        "runs": len(runs),
        "passes": sum(r["passed"] for r in runs),
        "join_s": [r["join_s"] for r in runs],
        "load_1min": [r["load_1min"] for r in runs],
        "joiner_ready_s": [{n: j["ready_s"] for n, j in r["joiners"].items()} for r in runs],
        "failures": failures,
    }


def _pythons(values: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    pairs = []
    for v in values:
        label, sep, path = v.partition("=")
        if not sep or not label or not path:
            raise click.BadParameter(f"expected LABEL=PATH, got {v!r}")
        pairs.append((label, path))
    return tuple(pairs) or (("current", sys.executable),)


def _exit_on_sigterm(_signum: int, _frame: object) -> None:
    raise SystemExit(143)


@click.command("join-load")
@click.option("--runs", type=int, default=20, show_default=True, help="runs per interpreter")
@click.option("--deadline", type=float, default=180.0, show_default=True,
              help="seconds from the joiners' start for both to step")  # fmt: skip
@click.option("--founder-timeout", type=float, default=180.0, show_default=True,
              help="seconds for the founder's first step")  # fmt: skip
@click.option("--busy", type=int, default=None, help="busy-loop processes (default: one a core)")
@click.option("--python", "pythons", multiple=True, metavar="LABEL=PATH",
              help="an interpreter whose chaos package the trainers run (repeatable; "
              "default: this one, labelled current)")  # fmt: skip
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench_join_load.json"),
              show_default=True)  # fmt: skip
def join_load_command(runs: int, deadline: float, founder_timeout: float, busy: int | None,
                      pythons: tuple[str, ...], out: Path) -> None:  # fmt: skip
    """Two trainers join a founder at once while every core runs a busy loop."""
    try:
        cfg = JoinLoadConfig(runs=runs, deadline_s=deadline, founder_timeout_s=founder_timeout,
                             busy=(os.cpu_count() or 1) if busy is None else busy,
                             pythons=_pythons(pythons))  # fmt: skip
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    # SIGTERM unwinds like Ctrl+C, so that the run in progress kills its trainers, their
    # daemons and the busy loops (its ``finally``) instead of leaving them running
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with LiveProgress("join-load", cfg.runs * len(cfg.pythons), "runs") as live:
        doc = measure(cfg, echo=live.done)
    for label, v in doc["variants"].items():
        click.echo(f"{label}: {v['passes']}/{v['runs']} runs passed "
                   f"({doc['busy_processes']} busy loops on {doc['cores']} cores)")  # fmt: skip
    out.write_text(json.dumps(doc, indent=2) + "\n")
    click.echo(f"wrote {out}")
