"""``chaos-emulate train``'s runs: devices in namespaces on shaped links, each in a CPU budget.

A case (mode, N devices, rate) runs on a star of its own (:class:`chaos.emulate.Network`):
device ``d<i>`` lives in a namespace joined to a hub namespace by one veth pair, tbf-shaped at
the rate on both ends, with half the one-way latency on each link (netem where the kernel has
it, else the delay relay), so two devices are ``latency_ms`` apart. Every device's processes
(its training process and the ``chaos-daemon`` it embeds) run in a cgroup of their own limited
to ``cpu_per_device`` cores (:class:`chaos.emulate.cpu_budget.CpuBudget`), with one torch
thread. ``single`` and the Chaos modes on one device run without a network, in the same CPU
budget.

Bytes: each device's veth ``tx_bytes`` (read inside its namespace) when device 0 records its
start (after every device joined) and after the run; their sum over devices, over the
cluster's samples, is the run's bytes per sample (everything on the wire: gradients, control
plane, heartbeats).

Every process, namespace and cgroup is removed on every exit path.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from chaos.emulate.cpu_budget import CpuBudget
from chaos.emulate.network import LinkSpec, Network, NetworkConfig
from chaos.emulate.train_bench import (
    OUTER_LR,
    OUTER_MOMENTUM,
    SLOW,
    TrainBenchConfig,
    goals,
    plot,
    run_figures,
    summarize,
    table,
)
from chaos.emulate.train_models import MODELS
from chaos.emulate.train_worker import MODES
from chaos.errors import ChaosError, ChaosTimeout, ConfigError
from chaos.launch import ProcessExited, kill_and_reap, spawn_worker, wait_until
from chaos.security import ClusterKey

__all__ = ["HUB", "PREFIX", "run_bench", "run_case", "train_command"]

HUB = "hub"
PREFIX = "chaostrain-"
"""The namespaces' name prefix (``chaos-emulate cleanup --prefix chaostrain-``)."""
PORT = 29600
"""The embedded daemons' control port on each device's own address."""
DAEMON_ARGS: tuple[str, ...] = ()  # the daemon's own heartbeat and failure timeouts
PROBE_BYTES = 256 << 10
"""The daemons' bandwidth probe (the default 4 MiB would take seconds of a slow link)."""
MBIT = 1e6
POLL_S = 0.1
END_GRACE_S = 60.0
"""How long after device 0's ``done`` the others may take to finish."""

Echo = Callable[[str], None]


def _records(path: Path) -> list[dict[str, Any]]:
    """The JSON lines written so far (a last line cut short is left out)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _has(path: Path, kind: str) -> bool:
    return any(r.get("kind") == kind for r in _records(path))


class _Case:
    """One case's processes, network and CPU budget (a context manager: all go on exit)."""

    def __init__(self, cfg: TrainBenchConfig, mode: str, n: int, mbit: float | None,
                 work: Path) -> None:  # fmt: skip
        self.cfg, self.mode, self.n, self.mbit, self.work = cfg, mode, n, mbit, work
        self.names = [f"d{i}" for i in range(n)]
        self.procs: list[subprocess.Popen[Any]] = []
        self.net: Network | None = None
        self.cpu: CpuBudget | None = None
        self.outs = [work / f"{d}.jsonl" for d in self.names]

    def __enter__(self) -> _Case:
        try:
            if self.mbit is not None:
                links = tuple(LinkSpec(HUB, d, self.mbit * MBIT) for d in self.names)
                self.net = Network(NetworkConfig(
                    nodes=(HUB, *self.names), links=links, prefix=PREFIX,
                    latency_s=self.cfg.latency_ms / 2000.0,
                    queue_s=max(0.05, 2 * self.cfg.latency_ms / 1000.0)))  # fmt: skip
                self.net.__enter__()
            self.cpu = CpuBudget(self.cfg.cpu_per_device)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kills every process group, then removes the network and the cgroups."""
        try:
            kill_and_reap(self.procs, group=True)
        finally:
            try:
                if self.net is not None:
                    self.net.close()
            finally:
                if self.cpu is not None:
                    self.cpu.close()

    def address(self, i: int) -> str:
        return self.net.address(self.names[i]) if self.net is not None else "127.0.0.1"

    def tx_bytes(self) -> list[int]:
        """Every device's bytes sent on its link so far (no network: zeros)."""
        if self.net is None:
            return [0] * self.n
        out = []
        for d in self.names:  # the hub is node 0: each device's veth towards it is "to-0"
            res = self.net.exec(d, ["cat", "/sys/class/net/to-0/statistics/tx_bytes"],
                                timeout_s=10.0)  # fmt: skip
            out.append(int(res.stdout.strip()))
        return out

    def spawn(self, i: int, argv: Sequence[str]) -> None:
        """Starts device ``i``'s process in its namespace (if any) and CPU budget."""
        if self.cpu is None:
            raise ChaosError("the case is not entered")
        prefix = self.cpu.prefix(self.names[i])
        popen: Any
        if self.net is not None:
            popen = functools.partial(self.net.popen, self.names[i], prefix=prefix)
        else:
            def popen(args: list[str], **kw: Any) -> subprocess.Popen[Any]:
                return subprocess.Popen([*prefix, *args], **kw)
        self.procs.append(spawn_worker(argv, log_path=self.work / f"{self.names[i]}.log",
                                       env={"OMP_NUM_THREADS": "1"}, popen=popen))  # fmt: skip


def _argv(cfg: TrainBenchConfig, case: _Case, i: int, key: Path, toml: Path) -> list[str]:
    """Device ``i``'s command line."""
    spec = MODELS[cfg.model]
    mode = case.mode.removesuffix(SLOW)
    port = PORT + (i if case.net is None else 0)  # on loopback the devices share an address
    argv = [sys.executable, "-m", "chaos.emulate.train_worker", "--id", case.names[i],
            "--listen", f"tcp://{case.address(i)}:{port}", "--out", str(case.outs[i]),
            "--mode", mode, "--model", cfg.model, "--rank", str(i), "--world", str(case.n),
            "--seed", str(cfg.seed), "--samples", str(cfg.budget), "--batch", str(spec.batch),
            "--lr", str(spec.lr), "--inner-steps", str(cfg.inner_steps),
            "--eval-every-samples", str(cfg.eval_every_samples),
            "--eval-samples", str(spec.eval_samples), "--host", case.address(i),
            "--cluster-key", str(key), "--timeout", str(cfg.start_timeout_s),
            *[f"--daemon-arg={a}" for a in (*DAEMON_ARGS, f"--config={toml}")]]  # fmt: skip
    if i > 0:
        argv += ["--join", f"tcp://{case.address(0)}:{PORT}"]
    if cfg.inner_time_s is not None:
        argv += ["--inner-time-s", str(cfg.inner_time_s)]
    if mode.startswith("local"):
        argv += ["--outer-lr", str(cfg.outer_lr), "--outer-momentum", str(cfg.outer_momentum)]
        if cfg.overlap:
            argv.append("--overlap")
    if case.mode.endswith(SLOW) and i == case.n - 1:
        argv += ["--slow-factor", str(cfg.slow_factor)]
    return argv


def _wait(case: _Case, pred: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Waits for ``pred`` while watching the devices (one that fails ends the wait).

    Raises:
        ChaosError: a device exited with an error (its log's tail in the message).
        ChaosTimeout: not within ``timeout_s``.
    """
    watch = {case.names[i]: p for i, p in enumerate(case.procs)}
    try:
        wait_until(pred, timeout_s, what, poll_s=POLL_S, watch=watch)
    except ProcessExited as exc:
        log = (case.work / f"{exc.name}.log").read_text(errors="replace")[-2000:]
        raise ChaosError(f"device {exc.name} failed (exit {exc.code}):\n{log}") from exc


def run_case(cfg: TrainBenchConfig, mode: str, n: int, mbit: float | None,
             echo: Echo) -> dict[str, Any]:  # fmt: skip
    """Runs one case to its sample budget or ``max_wall_s``; returns its figures.

    Raises:
        ChaosError: a device failed; ChaosTimeout: the devices did not start in time.
        RootRequiredError, EmulationError: no root, or no cgroup CPU controller.
    """
    work = Path(tempfile.mkdtemp(prefix="chaos-train-"))
    try:
        with _Case(cfg, mode, n, mbit, work) as case:
            key, toml = work / "cluster.key", work / "daemon.toml"
            ClusterKey.generate().write(key)
            toml.write_text(f"bandwidth_probe_bytes = {PROBE_BYTES}\n"
                            f"bandwidth_probe_chunk_bytes = 65536\n")  # fmt: skip
            return _drive(cfg, case, key, toml, echo)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _drive(cfg: TrainBenchConfig, case: _Case, key: Path, toml: Path,
           echo: Echo) -> dict[str, Any]:  # fmt: skip
    """Starts the devices (device 0 first), measures the run, collects the records."""
    t_launch = time.monotonic()
    case.spawn(0, _argv(cfg, case, 0, key, toml))
    _wait(case, lambda: _has(case.outs[0], "ready"), cfg.start_timeout_s, "device 0 ready")
    for i in range(1, case.n):
        case.spawn(i, _argv(cfg, case, i, key, toml))
    _wait(case, lambda: _has(case.outs[0], "start"), cfg.start_timeout_s, "every device joined")
    tx0 = case.tx_bytes()
    echo(f"  {case.mode} n={case.n} {case.mbit or '-'} Mbit/s: started "
         f"({time.monotonic() - t_launch:.1f} s to start and join)")
    stopped = "budget"

    def finished() -> bool:
        return all(p.poll() is not None for p in case.procs)

    try:
        _wait(case, lambda: _has(case.outs[0], "done") or finished(), cfg.max_wall_s,
              "device 0 at the sample budget")  # fmt: skip
        _wait(case, finished, END_GRACE_S, "every device done")
    except ChaosTimeout:
        stopped = "max_wall_s"
    tx1 = case.tx_bytes()
    records = [_records(p) for p in case.outs]
    fig = run_figures(records, cfg.target, cfg.budget)
    sent = [b - a for a, b in zip(tx0, tx1, strict=True)]
    samples = fig["samples"]
    return {"mode": case.mode, "devices": case.n, "mbit": case.mbit, "stopped_by": stopped,
            "tx_bytes_by_device": sent,
            "bytes_per_sample": (sum(sent) / case.n / samples
                                 if samples and case.net is not None else None),
            **fig}  # fmt: skip


def run_bench(cfg: TrainBenchConfig, echo: Echo) -> dict[str, Any]:
    """Every case of ``cfg``, ``repeats`` times (the cases interleaved within a repeat)."""
    runs = []
    for rep in range(cfg.repeats):
        for mode, n, mbit in cfg.cases():
            echo(f"repeat {rep + 1}/{cfg.repeats}: {mode}, {n} device(s), "
                 f"{'-' if mbit is None else f'{mbit:g}'} Mbit/s")  # fmt: skip
            r = run_case(cfg, mode, n, mbit, echo)
            r["repeat"] = rep
            ttt = r["time_to_target_s"]
            echo(f"  -> to target {'-' if ttt is None else f'{ttt:.1f} s'}, final loss "
                 f"{r['final_loss']}, {r['samples']} samples, stopped by {r['stopped_by']}")
            runs.append(r)
    return {"runs": runs}


# ----------------------------------------------------------------------------- the command


def _floats(text: str, name: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise click.BadParameter(f"{text!r}: expected comma-separated numbers", param_hint=name
                                 ) from exc  # fmt: skip


@click.command("train")
@click.option("--model", type=click.Choice(sorted(MODELS)), default="gpt", show_default=True)
@click.option("--modes", default=",".join(MODES), show_default=True,
              help="Comma-separated modes.")
@click.option("--devices", default="1,2,4", show_default=True, help="Device counts.")
@click.option("--mbit", default="10,20,50", show_default=True,
              help="Each device's link rate to the hub, Mbit/s, both ways.")
@click.option("--latency-ms", type=float, default=20.0, show_default=True,
              help="One-way delay between two devices (half on each link).")
@click.option("--samples", type=int, default=None,
              help="Cluster-wide sample budget of every run [gpt 24000, cnn 128000].")
@click.option("--target-loss", type=float, default=None,
              help="Held-out loss to reach [gpt 0.65, cnn 0.6].")
@click.option("--repeats", type=int, default=3, show_default=True)
@click.option("--cpu-per-device", type=float, default=0.45, show_default=True,
              help="Each device's cgroup CPU quota, cores (with one torch thread).")
@click.option("--max-wall-s", type=float, default=300.0, show_default=True)
@click.option("--inner-steps", type=int, default=32, show_default=True, help="LocalSteps' H.")
@click.option("--inner-time-s", type=float, default=None, help="LocalSteps' inner_time_s.")
@click.option("--overlap/--no-overlap", default=False, show_default=True,
              help="LocalSteps(overlap=True): the outer step beside the next inner phase.")
@click.option("--outer-lr", type=float, default=OUTER_LR, show_default=True,
              help="The outer SGD's learning rate (local modes).")
@click.option("--outer-momentum", type=float, default=OUTER_MOMENTUM, show_default=True,
              help="The outer SGD's momentum, Nesterov's when above 0 (local modes).")
@click.option("--slow-device", "slow_factor", type=float, default=1.0, show_default=True,
              help="Also run local modes with the last device this many times slower.")
@click.option("--eval-points", type=int, default=12, show_default=True,
              help="About how many evaluations a sync or single run makes.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Every run's curves, the medians and the goals.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="A PNG of loss against wall time and against samples.")
def train_command(model: str, modes: str, devices: str, mbit: str, latency_ms: float,
                  samples: int | None, target_loss: float | None, repeats: int,
                  cpu_per_device: float, max_wall_s: float, inner_steps: int,
                  inner_time_s: float | None, overlap: bool, outer_lr: float,
                  outer_momentum: float, slow_factor: float,
                  eval_points: int, seed: int, json_path: Path | None,
                  plot_path: Path | None) -> None:  # fmt: skip
    """Time to a target loss with real training on tc-shaped links (needs root).

    Every run trains the model to the same cluster-wide sample budget; device 0 evaluates a
    fixed held-out batch. Prints, per case, the median time to the target, the speed-up
    against one device, the bytes sent per device per sample, the compute utilisation and the
    loss at the budget, then the goals' PASS/FAIL.
    """
    try:
        cfg = TrainBenchConfig(
            model=model, modes=tuple(m.strip() for m in modes.split(",") if m.strip()),
            devices=tuple(int(x) for x in _floats(devices, "--devices")),
            mbits=_floats(mbit, "--mbit"), latency_ms=latency_ms, samples=samples,
            target_loss=target_loss, repeats=repeats, cpu_per_device=cpu_per_device,
            max_wall_s=max_wall_s, inner_steps=inner_steps, inner_time_s=inner_time_s,
            overlap=overlap, outer_lr=outer_lr, outer_momentum=outer_momentum,
            slow_factor=slow_factor, eval_points=eval_points, seed=seed)
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from exc
    if os.geteuid() != 0:
        click.echo("error: chaos-emulate train needs root (namespaces, tc, cgroups)", err=True)
        sys.exit(2)
    doc = _run_and_report(cfg, overlap)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(doc, indent=2) + "\n")
        click.echo(f"wrote {json_path}", err=True)
    if plot_path is not None:
        plot(doc["runs"], plot_path)
        click.echo(f"wrote {plot_path}", err=True)


def _run_and_report(cfg: TrainBenchConfig, overlap: bool) -> dict[str, Any]:
    """Runs the benchmark, prints the table and the goals; returns the JSON document."""
    def echo(msg: str) -> None:
        click.echo(msg, err=True)

    result = run_bench(cfg, echo)
    rows = summarize(result["runs"])
    verdicts = goals(rows, cfg.model, budget=cfg.budget)
    click.echo(f"chaos-emulate train: {cfg.model}, target loss {cfg.target:g}, "
               f"{cfg.budget} samples per run, median of {cfg.repeats}; "
               f"{cfg.cpu_per_device:g} cores and 1 torch thread per device")  # fmt: skip
    for line in table(rows, verdicts):
        click.echo(line)
    config = {k: v for k, v in cfg.__dict__.items()}
    return {"config": config, "target_loss": cfg.target, "samples": cfg.budget,
            "cpu_fairness": {"torch_threads": 1, "cgroup_cores_per_device": cfg.cpu_per_device,
                             "applies_to": "every device of every run, single included; the "
                             "device's training process and its embedded daemon"},
            "network": {"topology": "star: each device one tbf-shaped veth to a hub",
                        "latency_ms_device_to_device": cfg.latency_ms},
            "overlap": overlap, "runs": result["runs"], "medians": rows,
            "goals": verdicts}  # fmt: skip
