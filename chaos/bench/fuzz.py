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

``--key-holder`` runs :mod:`chaos.bench.fuzz_keyholder` instead: a key holder that never
joined forges scheduler, command, vote and refusal messages at a keyed cluster of daemons.
"""

from __future__ import annotations

import json
import random
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import click

from chaos.bench.fuzz_keyholder import ALL_KINDS, KeyHolderConfig, run_key_holder
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


def _print_key_holder(result: dict[str, Any]) -> None:
    """Prints the record of :func:`~chaos.bench.fuzz_keyholder.run_key_holder` as a table."""
    click.echo(f"{'attack':<20}{'sent':>7}{'accepted':>10}{'wedged':>8}{'recovered':>11}  refusals")
    control = {"control": result["control"]} if result["control"] else {}
    for name, r in {**control, **result["attacks"]}.items():
        rec = r["recovered_after_s"]
        reasons = ", ".join(f"{k} {v}" for k, v in r["refusals"].items()) or "-"
        click.echo(f"{name:<20}{r['frames_sent']:>7}{r['accepted']:>10}"
             f"{'YES' if r['wedged'] else 'no':>8}{'-' if rec is None else f'{rec:.1f} s':>11}"
             f"  {reasons}")  # fmt: skip
    for name, r in result["attacks"].items():
        by = r["accepted_by"]
        hits = {k: v for k, v in by.items() if v}
        if hits:
            click.echo(f"{name} ACCEPTED: " + "; ".join(
                f"{k} {len(v) if k == 'bindings_changed' else ', '.join(v)}"
                for k, v in hits.items()))  # fmt: skip
    rss = result["rss_ratio_max"]
    click.echo(f"accepted: {result['accepted']} (goal 0); wedged: {result['wedged']} (goal 0); "
         f"control clean: {result['control_clean']}; RSS max ratio "
         f"{'-' if rss is None else f'{rss:.3f}'} (goal within 10 %); "
         f"clusters started: {result['clusters_started']}")  # fmt: skip
    trainer = result["attacks"].get("trainer_future_epoch")
    if trainer is not None:
        t = trainer["trainer"]
        counts = ", ".join(f"{k} {v}" for k, v in t["member_a"].items() if v) or "-"
        click.echo(f"trainer_future_epoch: member a {counts}; RSS ratio {t['rss_ratio']}")


@click.command("fuzz")
@click.option(
    "--frames",
    type=click.IntRange(min=1),
    default=None,
    help="Frames sent at each target (a positive integer; required without --key-holder).",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False),
    required=True,
    help="Write the figures here.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the frames.")
@click.option(
    "--key-holder",
    is_flag=True,
    help="Instead: a key holder that never joined forges scheduler, command, vote and "
    "refusal messages at a keyed cluster (see chaos.bench.fuzz_keyholder).",
)
@click.option(
    "--daemons",
    type=click.IntRange(3, 7),
    default=4,
    show_default=True,
    help="With --key-holder: daemons in the keyed cluster.",
)
@click.option(
    "--attack-s",
    type=click.FloatRange(min=0.1),
    default=3.0,
    show_default=True,
    help="With --key-holder: seconds each attack kind lasts.",
)
@click.option(
    "--attack",
    "attacks",
    type=click.Choice(ALL_KINDS),
    multiple=True,
    help="With --key-holder: run only this attack kind (repeatable; default all).",
)
def fuzz_command(
    frames: int | None,
    json_path: str,
    seed: int,
    key_holder: bool,
    daemons: int,
    attack_s: float,
    attacks: tuple[str, ...],
) -> None:
    """Random and mutated frames at a live daemon, shard server and trainer on loopback, or
    (--key-holder) forged messages from a key holder at a keyed cluster."""
    if key_holder:
        cfg = KeyHolderConfig(daemons=daemons, attack_s=attack_s, attacks=attacks)
        with tempfile.TemporaryDirectory(prefix="chaos-bench-keyholder-") as tmp:
            result = run_key_holder(cfg, Path(tmp))
        Path(json_path).write_text(json.dumps(result, indent=2))
        _print_key_holder(result)
        click.echo(f"wrote {json_path}")
        return
    if frames is None:
        raise click.UsageError("Missing option '--frames' (or give --key-holder).")
    result = run_fuzz(frames, seed)
    Path(json_path).write_text(json.dumps(result, indent=2))
    _print_result(result)
    click.echo(f"wrote {json_path}")
