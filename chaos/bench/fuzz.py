"""``chaos-bench fuzz``: random and mutated frames at live processes on loopback.

Three real processes are started, each a target:

* ``daemon``: a ``chaos-daemon start`` (a cluster of one, no cluster key), fuzzed on its TCP
  endpoint and on its IPC endpoint;
* ``shard_server``: a donor's :class:`~chaos.replication.server.ShardServer` serving a small
  published training state (``python -m chaos.bench.fuzz_children shard``);
* ``trainer``: the data plane of a trainer: two :class:`~chaos.collectives.Communicator` members
  in one process allreducing in a ring without pause, with payload lanes
  (``python -m chaos.bench.fuzz_children trainer``); member ``a``'s allreduce ROUTER and lane
  listener are fuzzed.

Each target gets ``--frames`` frames: byte-level mutations (bit flips, truncation, insertion,
deletion, overwrite) and field-level mutations (wrong types, huge integers, deep nesting, strings
that are not UTF-8, bad versions) of a valid message of every type its decoder knows, random
msgpack, random bytes, oversized frames and odd multipart counts; a fifth of the trainer's go to
its lane port as raw TCP (mutated and random hellos, garbage after a valid-looking hello).

Afterwards every target must still answer a valid request (the daemon a ``status``, the shard
server a manifest request, the trainer's members another allreduce round and a TCP connection
at both of its ports). Reported per target: whether it crashed (died or stopped answering; goal
0), the refusals that came back by reason code, its RSS before and after (goal: within 10 %),
and the frames sent per second.

The jobs are split: :mod:`chaos.bench.fuzz_frames` makes the frames,
:mod:`chaos.bench.fuzz_targets` starts, fuzzes and checks each target,
:mod:`chaos.bench.fuzz_children` is the shard server's and the trainer's process, and this
module runs them all and reports.
"""

from __future__ import annotations

import json
import random
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import click

from chaos.bench.fuzz_targets import TARGETS
from chaos.launch import kill_and_reap

__all__ = ["fuzz_command", "run_fuzz"]


def run_fuzz(frames: int, seed: int, targets: tuple[str, ...] = tuple(TARGETS)) -> dict[str, Any]:
    """Starts every target, fuzzes it with ``frames`` frames, and checks it afterwards.

    Args:
        frames: Frames per target.
        seed: Seed of the random source (a run is repeatable up to timing).
        targets: The targets to run (default all).

    Returns:
        The JSON record (see the module docstring).

    Raises:
        ChaosTimeout: a target did not start within
            :data:`~chaos.bench.fuzz_targets.START_TIMEOUT_S`.
        ProcessExited: a target exited while it started.
    """
    results: dict[str, Any] = {}
    daemons: list[subprocess.Popen[Any]] = []
    workers: list[subprocess.Popen[Any]] = []  # process-group leaders (spawn_worker)
    total_sent, total_s = 0, 0.0
    with tempfile.TemporaryDirectory(prefix="chaos-bench-fuzz-") as tmp:
        try:
            for name in targets:
                rng = random.Random(f"{seed}:{name}")
                procs = daemons if name == "daemon" else workers
                t = TARGETS[name](Path(tmp), frames, rng, procs)
                results[name] = t.to_json()
                total_sent += t.sent
                total_s += t.send_s
        finally:
            kill_and_reap(daemons, timeout_s=10.0)
            kill_and_reap(workers, group=True, timeout_s=10.0)
    procs = daemons + workers
    return {
        "frames_per_target": frames,
        "seed": seed,
        "crashes": sum(1 for r in results.values() if r["crashed"]),
        "frames_sent": total_sent,
        "frames_per_s": round(total_sent / total_s, 1) if total_s > 0 else None,
        "targets": results,
        "reaped": all(p.poll() is not None for p in procs),
    }


def _print_result(result: dict[str, Any]) -> None:
    mib = 1 << 20
    click.echo(
        f"{'target':<14}{'sent':>8}{'frames/s':>10}{'crashed':>9}{'RSS before':>12}"
        f"{'after':>9}{'ratio':>7}"
    )
    for name, r in result["targets"].items():
        click.echo(
            f"{name:<14}{r['frames_sent']:>8}{r['frames_per_s'] or 0:>10.0f}"
            f"{'YES' if r['crashed'] else 'no':>9}{r['rss_before_bytes'] / mib:>10.1f}Mi"
            f"{r['rss_after_bytes'] / mib:>7.1f}Mi{r['rss_ratio'] or 0:>7.3f}"
        )
    for name, r in result["targets"].items():
        if r["refusals"]:
            reasons = ", ".join(f"{k} {v}" for k, v in r["refusals"].items())
            click.echo(f"{name} refusals: {reasons}")
        if r["crashed"]:
            click.echo(f"{name} CRASHED at frame {r['crashed_at_frame']}; last frames in the JSON")
    click.echo(
        f"crashes: {result['crashes']} (goal 0); {result['frames_sent']} frames at "
        f"{result['frames_per_s'] or 0:.0f} frames/s"
    )


@click.command("fuzz")
@click.option(
    "--frames",
    type=click.IntRange(min=1),
    required=True,
    help="Frames sent at each target (a positive integer).",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False),
    required=True,
    help="Write the figures here.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the frames.")
def fuzz_command(frames: int, json_path: str, seed: int) -> None:
    """Random and mutated frames at a live daemon, shard server and trainer on loopback."""
    result = run_fuzz(frames, seed)
    Path(json_path).write_text(json.dumps(result, indent=2))
    _print_result(result)
    click.echo(f"wrote {json_path}")
