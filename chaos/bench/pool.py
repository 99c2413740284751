"""``chaos-bench pool``: pools several ``chaos-bench primitives`` runs into one estimate.

One run gives 10-16 samples per primitive, and on a shared host its ``added_p50_ms`` moves by a
millisecond or two from run to run with the same code. Pooling the runs of one arm of an A/B
comparison (all their stall samples, and all their placebo samples) gives a steadier figure:

    added p50 = median(stall samples of all runs) - median(null samples of all runs)

with a bootstrap interval: both sample sets are resampled with replacement ``resamples`` times
(a fixed seed, so the same files give the same interval), and the 5th and 95th percentiles of
the resampled differences are reported. The interval says how far the pooled figure may move
with other draws of the same noise; it is what to look at before calling a difference between
two arms real.

It also lists each run on its own: its baseline step (the median undisturbed step, which
grows when the shared host is busy) and its added p50 per primitive. Over three runs or more it
gives the correlation between the two, which shows how much of the spread between runs follows
the host's load rather than the code.

Usage::

    chaos-bench pool --json pooled.json run1.json run2.json ...
"""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path
from typing import Any

import click

from chaos.bench.primitives import PRIMITIVES
from chaos.errors import ConfigError

DEFAULT_RESAMPLES = 2000
"""Bootstrap resamples; more give a steadier interval at a linear cost (2000 take well under a
second for a few hundred samples)."""
_SEED = 1


def _samples(doc: dict[str, Any], path: Path, key: str) -> tuple[list[float], list[float]]:
    try:
        stall = doc[f"{key}_ms"]["samples"]
        null = doc["null_ms"][key]["samples"]
    except (KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: not a chaos-bench primitives JSON (missing {exc})") from exc
    for name, xs in (("stall", stall), ("null", null)):
        if not isinstance(xs, list) or not all(isinstance(x, (int, float)) for x in xs):
            raise ConfigError(f"{path}: {key} {name} samples must be a list of numbers")
    return [float(x) for x in stall], [float(x) for x in null]


def _read(path: Path) -> dict[str, Any]:
    """One run's JSON object.

    Raises:
        ConfigError: the file is missing, is not JSON, or is not an object.
    """
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read it as JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: not a chaos-bench primitives JSON object")
    return doc


def load_runs(paths: list[Path]) -> dict[str, tuple[list[float], list[float]]]:
    """Reads ``chaos-bench primitives`` JSON files and pools their samples.

    Args:
        paths: The runs' JSON files.

    Returns:
        Per primitive, ``(stall samples, null samples)`` of all runs together, in ms.

    Raises:
        ConfigError: no file given, a file is missing, is not JSON, or lacks the samples.
    """
    return _pool([(path, _read(path)) for path in paths])


def _pool(docs: list[tuple[Path, dict[str, Any]]]) -> dict[str, tuple[list[float], list[float]]]:
    if not docs:
        raise ConfigError("no run to pool")
    pooled: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in PRIMITIVES}
    for path, doc in docs:
        for key in PRIMITIVES:
            stall, null = _samples(doc, path, key)
            pooled[key][0].extend(stall)
            pooled[key][1].extend(null)
    return pooled


def per_run(paths: list[Path]) -> list[dict[str, Any]]:
    """Each run's own figures: its baseline step and its added p50 per primitive.

    Args:
        paths: The runs' JSON files.

    Returns:
        One ``{"run", "baseline_step_ms", "added_p50_ms": {primitive: ms}}`` per run; a figure
        the file lacks is ``None``.

    Raises:
        ConfigError: a file is missing, is not JSON, or is not an object.
    """
    return _rows([(path, _read(path)) for path in paths])


def _rows(docs: list[tuple[Path, dict[str, Any]]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for path, doc in docs:
        raw = doc.get("added_p50_ms")
        added: dict[str, Any] = raw if isinstance(raw, dict) else {}
        rows.append(
            {
                "run": str(path),
                "baseline_step_ms": _number(doc.get("baseline_step_ms")),
                "added_p50_ms": {k: _number(added.get(k)) for k in PRIMITIVES},
            }
        )
    return rows


def _number(x: object) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def baseline_correlation(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Per primitive, the Pearson correlation over runs between the baseline step and the
    added p50; ``None`` with fewer than three runs that have both, or when either is constant.

    Args:
        rows: :func:`per_run`'s output.

    Returns:
        ``{primitive: r or None}``.
    """
    out: dict[str, float | None] = {}
    for key in PRIMITIVES:
        pairs = [
            (r["baseline_step_ms"], r["added_p50_ms"][key])
            for r in rows
            if r["baseline_step_ms"] is not None and r["added_p50_ms"][key] is not None
        ]
        xs, ys = [x for x, _ in pairs], [y for _, y in pairs]
        try:
            out[key] = statistics.correlation(xs, ys) if len(pairs) >= 3 else None
        except statistics.StatisticsError:  # a constant series
            out[key] = None
    return out


def pooled_added(
    stall: list[float], null: list[float], resamples: int = DEFAULT_RESAMPLES
) -> dict[str, Any]:
    """The pooled added stall and its 90% bootstrap interval.

    Args:
        stall: The primitive's stall samples, ms.
        null: The placebo samples of the same runs, ms.
        resamples: Bootstrap resamples (at least 100).

    Returns:
        ``{"added_p50_ms", "ci90_ms": [low, high], "n", "null_n"}``.

    Raises:
        ConfigError: either sample list is empty, or ``resamples`` < 100.
    """
    if not stall or not null:
        raise ConfigError("pooling needs at least one stall and one null sample")
    if resamples < 100:
        raise ConfigError(f"resamples must be at least 100, got {resamples}")
    rng = random.Random(_SEED)
    diffs = sorted(
        statistics.median(rng.choices(stall, k=len(stall)))
        - statistics.median(rng.choices(null, k=len(null)))
        for _ in range(resamples)
    )
    low, high = diffs[int(0.05 * resamples)], diffs[int(0.95 * resamples) - 1]
    return {
        "added_p50_ms": statistics.median(stall) - statistics.median(null),
        "ci90_ms": [low, high],
        "n": len(stall),
        "null_n": len(null),
    }


@click.command("pool")
@click.argument("runs", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write here."
)
@click.option(
    "--resamples",
    type=click.IntRange(100),
    default=DEFAULT_RESAMPLES,
    show_default=True,
    help="Bootstrap resamples for the 90% interval.",
)
def pool_command(runs: tuple[Path, ...], json_path: str | None, resamples: int) -> None:
    """Pools ``chaos-bench primitives`` runs: added stall p50 with a 90% bootstrap interval."""
    try:
        docs = [(path, _read(path)) for path in runs]  # each file read once
        pooled = _pool(docs)
        result: dict[str, Any] = {"runs": [str(p) for p in runs], "resamples": resamples}
        for key in PRIMITIVES:
            result[key] = pooled_added(*pooled[key], resamples=resamples)
        result["per_run"] = _rows(docs)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    result["baseline_correlation"] = baseline_correlation(result["per_run"])
    click.echo(f"{'primitive':<17}{'added p50 ms':>13}{'90% interval ms':>20}{'n':>5}{'null n':>8}")
    for key in PRIMITIVES:
        r = result[key]
        interval = f"[{r['ci90_ms'][0]:+.2f}, {r['ci90_ms'][1]:+.2f}]"
        click.echo(f"{key:<17}{r['added_p50_ms']:>+13.2f}{interval:>20}{r['n']:>5}{r['null_n']:>8}")
    click.echo(f"pooled {len(runs)} run(s): added = median(stall) - median(null) over all samples")
    _echo_runs(result["per_run"], result["baseline_correlation"])
    if json_path is not None:
        Path(json_path).write_text(json.dumps(result, indent=2))
        click.echo(f"wrote {json_path}")


def _echo_runs(rows: list[dict[str, Any]], corr: dict[str, float | None]) -> None:
    """Prints each run's baseline step and added p50s, then the correlation line."""

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:+.2f}"

    click.echo(f"{'run':<32}{'baseline step ms':>17}" + "".join(f"{k:>17}" for k in PRIMITIVES))
    for r in rows:
        base = "-" if r["baseline_step_ms"] is None else f"{r['baseline_step_ms']:.2f}"
        name = Path(r["run"]).name[-31:]
        added = "".join(f"{ms(r['added_p50_ms'][k]):>17}" for k in PRIMITIVES)
        click.echo(f"{name:<32}{base:>17}{added}")
    shown = ", ".join(f"{k} {'-' if v is None else f'{v:+.2f}'}" for k, v in corr.items())
    click.echo(f"correlation of baseline step with added p50 over runs: {shown}")
