"""``chaos-bench hetero``: a constant global batch on devices of different speeds.

A loopback cluster of ``--nodes`` real training processes (each with its embedded daemon) trains
a small MLP with a global batch of ``--global-batch`` samples a step. Every sample costs a
device ``--sample-time`` seconds of compute (a sleep per sample, beside the model's own work),
and one device is ``--slowdown`` times slower. The run is made twice, one after the other:

- ``equal``: every member uses ``global_batch / nodes`` samples (the split a script without
  ``TrainerConfig.global_batch`` would hard-code); the slow device sets every step's pace;
- ``proportional``: ``TrainerConfig.global_batch``: the scheduler splits the global batch in
  proportion to the members' measured throughput, so they finish their compute together.

Both use ``update(num_samples=...)``, so each step's gradient is that of the same number of
samples. It prints the steps (and samples) per second of each run side by side, measured on the
founder's steps over ``--measure`` seconds once every member trains (and, for the split, once
it is installed), and writes them as JSON.

The worker is this module run as a script (``python -m chaos.bench.hetero worker ...``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click

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

MODES = ("equal", "proportional")
DAEMON_ARGS = ("--heartbeat-interval", "0.2", "--failure-timeout", "1.0")


@dataclass(frozen=True)
class HeteroConfig:
    """One benchmark run's settings.

    Args:
        nodes: Devices (3-8).
        global_batch: Samples per step over the cluster; a multiple of ``nodes``.
        sample_s: Compute per sample on a normal device, in seconds (a sleep).
        slowdown: How many times slower the slow device is per sample.
        measure_s: How long each run is measured, once it is steady.
        settle_s: How long each run trains, every member in, before it is measured.
        timeout_s: The limit on starting and joining each run's cluster.
        work_dir: Where the workers' logs go (default: a temporary directory).

    Raises:
        ConfigError: a value out of range.
    """

    nodes: int = 4
    global_batch: int = 64
    sample_s: float = 0.001
    slowdown: float = 5.0
    measure_s: float = 15.0
    settle_s: float = 5.0
    timeout_s: float = 120.0
    work_dir: Path | None = None

    def __post_init__(self) -> None:
        if not 3 <= self.nodes <= 8:
            raise ConfigError(f"nodes must be 3-8, got {self.nodes}")
        if self.global_batch < self.nodes or self.global_batch % self.nodes:
            raise ConfigError(
                f"global_batch ({self.global_batch}) must be a multiple of nodes ({self.nodes})"
            )
        for name in ("sample_s", "measure_s", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be positive")
        if not self.slowdown >= 1.0 or not self.settle_s >= 0:
            raise ConfigError("slowdown must be >= 1 and settle_s >= 0")


# ----------------------------------------------------------------------------- the runs


@dataclass
class _Member:
    id: str
    address: str
    out: Path
    log: Path
    proc: Any

    def records(self) -> list[dict[str, Any]]:
        if not self.out.exists():
            return []
        lines = self.out.read_text().splitlines()
        return [json.loads(x) for x in lines if x.endswith("}")]

    def last(self) -> dict[str, Any]:
        steps = [r for r in self.records() if "step" in r and "t" in r]
        return steps[-1] if steps else {}


class _Cluster:
    def __init__(self, root: Path, cfg: HeteroConfig, mode: str) -> None:
        self.root, self.cfg, self.mode = root, cfg, mode
        self.members: dict[str, _Member] = {}

    def start(self, nid: str, join: str | None, slow: bool) -> _Member:
        cfg = self.cfg
        address = free_tcp_address()
        out, log = self.root / f"{nid}.jsonl", self.root / f"{nid}.log"
        sample_s = cfg.sample_s * (cfg.slowdown if slow else 1.0)
        argv = [sys.executable, "-m", "chaos.bench.hetero", "worker", "--id", nid]
        argv += ["--listen", address, "--out", str(out), "--mode", self.mode]
        argv += ["--global-batch", str(cfg.global_batch), "--nodes", str(cfg.nodes)]
        argv += ["--sample-time", repr(sample_s)]
        argv += [f"--daemon-arg={a}" for a in DAEMON_ARGS]
        argv += ["--join", join] if join else []
        env = {"TMPDIR": str(self.root), LOG_LEVEL_ENV: "WARNING"}
        proc = spawn_worker(argv, log_path=log, env=env, append=False)
        member = _Member(nid, address, out, log, proc)
        self.members[nid] = member
        return member

    def wait(self, pred: Callable[[], bool], what: str) -> None:
        procs = {m.id: m.proc for m in self.members.values()}
        try:
            wait_until(pred, self.cfg.timeout_s, what, poll_s=0.1, watch=procs)
        except ProcessExited as exc:
            text = self.members[exc.name].log.read_text(errors="replace").strip().splitlines()
            raise ChaosError(f"worker {exc.name} exited: {text[-1] if text else ''}") from exc

    def close(self) -> None:
        kill_and_reap([m.proc for m in self.members.values()], group=True)


def _run_mode(
    cfg: HeteroConfig, mode: str, root: Path, echo: Callable[[str], None]
) -> dict[str, Any]:
    """One run: start the cluster, let it settle, measure the founder's steps."""
    root.mkdir(parents=True, exist_ok=True)
    ids = [f"n{i}" for i in range(cfg.nodes)]
    slow = ids[-1]
    with contextlib.closing(_Cluster(root, cfg, mode)) as cl:
        first = cl.start(ids[0], None, slow=False)
        cl.wait(lambda: first.last().get("step", 0) >= 3, f"{ids[0]} to train")
        for k, nid in enumerate(ids[1:], start=2):  # one join at a time

            def joined(k: int = k) -> bool:
                return all(m.last().get("world") == k for m in cl.members.values())

            cl.start(nid, first.address, slow=nid == slow)
            cl.wait(joined, f"{nid} to join ({mode})")
        n = cfg.nodes
        if mode == "proportional":

            def split_in() -> bool:
                split = first.last().get("split") or {}
                return len(split) == n and split.get(slow, 0) < cfg.global_batch // n

            cl.wait(split_in, "the speed-proportional split")
        time.sleep(cfg.settle_s)
        t0 = time.time()
        time.sleep(cfg.measure_s)
        t1 = time.time()
        records = {m.id: m.records() for m in cl.members.values()}
    steps = [r for r in records[ids[0]] if "t" in r and t0 <= r["t"] <= t1 and r["world"] == n]
    if len(steps) < 3:
        raise ChaosError(f"{mode}: only {len(steps)} steps in the measured window")
    span = steps[-1]["t"] - steps[0]["t"]
    rate = (len(steps) - 1) / span
    gaps = [(b["t"] - a["t"]) * 1e3 for a, b in zip(steps, steps[1:], strict=False)]
    local: dict[str, float] = {}
    for nid, recs in records.items():
        mine = [r["batch"] for r in recs if "t" in r and t0 <= r["t"] <= t1]
        local[nid] = round(statistics.mean(mine), 2) if mine else float("nan")
    result = {
        "steps_per_s": rate,
        "samples_per_s": rate * cfg.global_batch,
        "step_ms_p50": statistics.median(gaps),
        "steps": len(steps),
        "local_batch_mean": local,
        "split_last": steps[-1].get("split") or {},
        "slow_node": slow,
    }
    echo(f"{mode:>13}: {rate:7.2f} steps/s, local batches {local}")
    return result


def run(cfg: HeteroConfig, echo: Callable[[str], None]) -> dict[str, Any]:
    """Runs both modes, one after the other.

    Returns:
        The figures: per mode steps and samples per second, the median step, the members'
        mean local batch; and the speed-up of the proportional split.

    Raises:
        ChaosError: a worker failed, or a run did not settle in time.
    """
    with _work_dir(cfg.work_dir) as root:
        runs = {mode: _run_mode(cfg, mode, root / mode, echo) for mode in MODES}
    conf = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    return {
        "config": conf,
        **runs,
        "speedup": runs["proportional"]["steps_per_s"] / runs["equal"]["steps_per_s"],
    }


@contextlib.contextmanager
def _work_dir(path: Path | None) -> Iterator[Path]:
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="chaos-hetero-") as tmp:
        yield Path(tmp)


@click.command("hetero")
@click.option("--nodes", type=click.IntRange(3, 8), default=HeteroConfig.nodes, show_default=True)
@click.option(
    "--global-batch", type=click.IntRange(3), default=HeteroConfig.global_batch, show_default=True
)
@click.option(
    "--sample-time", "sample_s", type=click.FloatRange(0.0, min_open=True),
    default=HeteroConfig.sample_s, show_default=True, metavar="SECONDS",
    help="Compute per sample on a normal device, in seconds.",
)  # fmt: skip
@click.option(
    "--slowdown", type=click.FloatRange(1.0), default=HeteroConfig.slowdown, show_default=True,
    help="How many times slower the slow device is.",
)  # fmt: skip
@click.option(
    "--measure", "measure_s", type=click.FloatRange(1.0), default=HeteroConfig.measure_s,
    show_default=True, help="Seconds measured per run.",
)  # fmt: skip
@click.option(
    "--settle", "settle_s", type=click.FloatRange(0.0), default=HeteroConfig.settle_s,
    show_default=True, help="Seconds trained before measuring.",
)  # fmt: skip
@click.option(
    "--work-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
    help="Keep the workers' logs here.",
)  # fmt: skip
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False), required=True, help="Write here."
)
def hetero_command(
    nodes: int,
    global_batch: int,
    sample_s: float,
    slowdown: float,
    measure_s: float,
    settle_s: float,
    work_dir: Path | None,
    json_path: str,
) -> None:
    """A constant global batch on one slow device: speed-proportional vs equal split."""
    try:
        cfg = HeteroConfig(nodes, global_batch, sample_s, slowdown, measure_s, settle_s,
                           work_dir=work_dir)  # fmt: skip
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    with LiveProgress("hetero") as live:
        result = run(cfg, live)
    click.echo(f"{'split':>13}{'steps/s':>10}{'samples/s':>12}{'step p50 ms':>13}")
    for mode in MODES:
        r = result[mode]
        click.echo(f"{mode:>13}{r['steps_per_s']:>10.2f}{r['samples_per_s']:>12.1f}"
                   f"{r['step_ms_p50']:>13.1f}")  # fmt: skip
    click.echo(f"speed-up of the proportional split: {result['speedup']:.2f}x")
    Path(json_path).write_text(json.dumps(result, indent=2))


# ----------------------------------------------------------------------------- the worker


def _worker(argv: list[str]) -> int:
    """One member: trains with its share of the global batch, logs one line a step."""
    import torch

    from chaos.trainer.worker import add_member_arguments, local_data, start_member, write_record

    ap = argparse.ArgumentParser(prog="chaos.bench.hetero worker")
    add_member_arguments(ap)
    ap.add_argument("--mode", choices=MODES, required=True)
    ap.add_argument("--global-batch", type=int, required=True)
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--sample-time", type=float, required=True, help="seconds per sample")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    xs, ys = local_data(args.id, 1024, 32, 8)
    proportional = args.mode == "proportional"
    trainer = start_member(
        args, model, opt, step_timeout_s=30.0,
        global_batch=args.global_batch if proportional else None,
    )  # fmt: skip
    equal = args.global_batch // args.nodes
    with args.out.open("a") as out:
        while True:
            size = (trainer.local_batch_size or equal) if proportional else equal
            idx = (torch.arange(size) + trainer.step * size) % xs.shape[0]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xs[idx]), ys[idx]).backward()
            time.sleep(args.sample_time * size)  # the device's compute per sample
            trainer.update(num_samples=size)
            trainer.check_state_replication()
            write_record(out, {"t": time.time(), "step": trainer.step, "world":
                               trainer.world_size, "batch": size,
                               "split": trainer.batch_sizes})  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        sys.exit(_worker(sys.argv[2:]))
    hetero_command()
