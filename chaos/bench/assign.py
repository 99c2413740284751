"""``chaos-bench assign``: shard assignment quality and planning time (paper Fig. 16, extended).

Random instances in the paper's setting (2-16 neighbours, 100-1000 Mbit/s, 1-50 ms propagation,
0-500 ms tau) over the state tensor lists of the paper's models. Every method's makespan is
compared with the best MILP optimum over s, counted only where CBC proved it optimal.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from chaos.scheduling import Neighbor, lower_bound, plan_replication

DEFAULT_PER_SHARD_COST_S = 4e-6
"""Per-shard cost c used by the benchmark, in seconds. ``chaos-bench shard-cost`` measures it on
the ZeroMQ transport: 3.2-3.8 us over TCP loopback on the 2-core reference machine (see
docs/scheduling.md). Pass ``--per-shard-cost`` to use your own measurement."""

# (label, method, layout)
METHODS: tuple[tuple[str, str, str], ...] = (
    ("chaos", "chaos", "flat"),
    ("chaos-per-tensor", "chaos", "per-tensor"),
    ("scan", "scan", "flat"),
    ("even", "even", "flat"),
    ("single-source", "single-source", "flat"),
    ("milp", "milp", "flat"),
)


@dataclass(frozen=True)
class Instance:
    """One random planning problem."""

    model: str
    tensor_sizes: list[int]
    neighbors: list[Neighbor]


def random_neighbors(rng: random.Random, count: int) -> list[Neighbor]:
    """Neighbours drawn from the paper's setting (the ranges listed in docs/scheduling.md)."""
    return [
        Neighbor.from_bandwidth(
            f"n{i}",
            bandwidth_bps=rng.uniform(100e6, 1000e6),
            prop_s=rng.uniform(0.001, 0.050),
            sync_s=rng.uniform(0.0, 0.500),
        )
        for i in range(count)
    ]


def make_instances(count: int, seed: int, models: Sequence[str]) -> list[Instance]:
    """Deterministic instances: models in rotation, neighbours drawn from ``seed``."""
    from chaos.models import state_tensor_sizes

    rng = random.Random(seed)
    sizes = {m: list(state_tensor_sizes(m)) for m in models}
    return [
        Instance(
            models[i % len(models)],
            sizes[models[i % len(models)]],
            random_neighbors(rng, rng.randint(2, 16)),
        )
        for i in range(count)
    ]


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run_instances(
    instances: Sequence[Instance], c: float, milp_time_limit_s: float, progress: bool
) -> list[dict[str, Any]]:
    """Runs every method on every instance; one record per instance."""
    records = []
    t0 = time.perf_counter()
    for idx, inst in enumerate(instances):
        rec: dict[str, Any] = {
            "model": inst.model,
            "neighbors": len(inst.neighbors),
            "state_bytes": sum(inst.tensor_sizes),
            "lower_bound_s": lower_bound(sum(inst.tensor_sizes), inst.neighbors),
            "methods": {},
        }
        for label, method, layout in METHODS:
            plan = plan_replication(
                inst.tensor_sizes,
                inst.neighbors,
                c,
                layout,
                method,
                time_limit_s=milp_time_limit_s,
                total_time_limit_s=6 * milp_time_limit_s,
            )
            rec["methods"][label] = {
                "makespan_s": plan.makespan_s,
                "shard_size": plan.shard_size,
                "shards": plan.num_shards,
                "solve_ms": plan.solve_s * 1e3,
                "proven_optimal": plan.proven_optimal,
            }
        records.append(rec)
        if progress and (idx + 1) % 10 == 0:
            el = time.perf_counter() - t0
            print(f"  {idx + 1}/{len(instances)} instances, {el:.1f} s", file=sys.stderr)
    return records


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Gap statistics relative to the proven MILP optimum, and solve-time percentiles."""
    proven = [r for r in records if r["methods"]["milp"]["proven_optimal"]]
    out: dict[str, Any] = {}
    for label, _, _ in METHODS:
        gaps = []
        for r in proven:
            opt = r["methods"]["milp"]["makespan_s"]
            gaps.append((r["methods"][label]["makespan_s"] - opt) / opt)
        solve = [r["methods"][label]["solve_ms"] for r in records]
        out[label] = {
            "gap_mean": statistics.fmean(gaps) if gaps else float("nan"),
            "gap_max": max(gaps) if gaps else float("nan"),
            "solve_ms_p50": _pct(solve, 0.5),
            "solve_ms_p99": _pct(solve, 0.99),
        }
    return out


def planning_time(repeats: int, seed: int, c: float) -> dict[str, float]:
    """Planning time of ``"chaos"`` for 16 neighbours and a 1 GiB state (flat layout)."""
    rng = random.Random(seed + 1)
    times = []
    for _ in range(repeats):
        neighbors = random_neighbors(rng, 16)
        t0 = time.perf_counter()
        plan_replication([1 << 30], neighbors, c, "flat", "chaos")
        times.append((time.perf_counter() - t0) * 1e3)
    return {
        "neighbors": 16,
        "state_bytes": 1 << 30,
        "solve_ms_p50": statistics.median(times),
        "solve_ms_p99": _pct(times, 0.99),
    }


def print_table(result: dict[str, Any]) -> None:
    """Plain-text summary table on stdout."""
    print(f"\n{'method':<18}{'gap mean':>10}{'gap max':>10}{'solve p50':>12}{'solve p99':>12}")
    for label, row in result["methods"].items():
        print(
            f"{label:<18}{row['gap_mean'] * 100:>9.2f}%{row['gap_max'] * 100:>9.2f}%"
            f"{row['solve_ms_p50']:>10.2f}ms{row['solve_ms_p99']:>10.2f}ms"
        )
    pt = result["planning_16x1GiB"]
    print(
        f"\ninstances {result['instances']}, MILP optimum proven on "
        f"{result['optimum_proven'] * 100:.1f}%, per-shard cost c = {result['per_shard_cost_s']} s"
    )
    print(
        f"planning time, chaos, 16 neighbours, 1 GiB: p50 {pt['solve_ms_p50']:.2f} ms, "
        f"p99 {pt['solve_ms_p99']:.2f} ms; total run {result['total_s']:.1f} s"
    )


@click.command("assign")
@click.option("--instances", type=click.IntRange(min=1), default=200, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the results as JSON to this file.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Draw a Fig. 16-style PNG to this file.",
)
@click.option(
    "--per-shard-cost",
    "c",
    type=click.FloatRange(min=0.0),
    default=DEFAULT_PER_SHARD_COST_S,
    show_default=True,
    help="Per-shard cost c in seconds (measure: chaos-bench shard-cost).",
)
@click.option("--models", default=None, help="Comma-separated model names (default: all).")
@click.option(
    "--milp-time-limit",
    type=click.FloatRange(min=0.1),
    default=10.0,
    show_default=True,
    help="CBC time limit per solve, seconds.",
)
def assign_command(
    instances: int,
    seed: int,
    json_path: Path | None,
    plot_path: Path | None,
    c: float,
    models: str | None,
    milp_time_limit: float,
) -> None:
    """Shard-assignment quality vs the MILP optimum, and planning time (Fig. 16)."""
    from chaos.models import MODEL_NAMES

    names = tuple(m.strip() for m in models.split(",")) if models else MODEL_NAMES
    unknown = [m for m in names if m not in MODEL_NAMES and not m.startswith("synthetic:")]
    if unknown:
        raise click.BadParameter(f"unknown models {unknown}; choose from {MODEL_NAMES}")
    t0 = time.perf_counter()
    insts = make_instances(instances, seed, names)
    records = run_instances(insts, c, milp_time_limit, progress=True)
    result: dict[str, Any] = {
        "instances": instances,
        "seed": seed,
        "per_shard_cost_s": c,
        "optimum_proven": sum(bool(r["methods"]["milp"]["proven_optimal"]) for r in records)
        / len(records),
        "methods": summarize(records),
        "planning_16x1GiB": planning_time(50, seed, c),
        "records": records,
    }
    result["total_s"] = time.perf_counter() - t0
    print_table(result)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1))
        print(f"wrote {json_path}")
    if plot_path is not None:
        from chaos.bench.plots import plot_assign

        plot_assign(result, plot_path)
        print(f"wrote {plot_path}")
