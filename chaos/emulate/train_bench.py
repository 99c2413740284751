"""``chaos-emulate train``: time to a target loss on shaped links, real training (pure parts).

What it answers: does a Chaos cluster behind slow home links (10-50 Mbit/s) train faster than
one device? Every run trains a real model (:mod:`chaos.emulate.train_models`) to the same
cluster-wide sample budget in one mode (``single``, ``sync``, ``sync-int8``, ``local``,
``local-int8``: :mod:`chaos.emulate.train_worker`), with N devices in network namespaces behind
tbf-shaped links (:mod:`chaos.emulate.train_bench_run`), and every device holds the same CPU
share (one torch thread and a cgroup quota). Device 0 evaluates a fixed held-out batch.

This module holds the decisions that need no I/O: the run's configuration, the curve a run's
records give (:func:`run_figures`), the time to the target (:func:`time_to_target`), the loss
at the sample budget (:func:`loss_at_samples`), the medians over repeats (:func:`summarize`),
the goals' verdicts (:func:`goals`) and the table (:func:`table`); and the plot.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chaos.emulate.train_models import MODELS
from chaos.emulate.train_worker import MODES
from chaos.errors import ConfigError

__all__ = [
    "DEFAULT_SAMPLES",
    "GOAL_BYTES_RATIO",
    "GOAL_FINAL_LOSS",
    "GOAL_SPEEDUP",
    "GOAL_STRAGGLER",
    "GOAL_UTILISATION",
    "TrainBenchConfig",
    "cluster_samples",
    "goals",
    "loss_at_samples",
    "plot",
    "run_figures",
    "summarize",
    "table",
    "time_to_target",
]

DEFAULT_SAMPLES = {"gpt": 24_000, "cnn": 128_000}
"""The default cluster-wide sample budget per model (one device takes about 1500 or 2000
steps)."""
OUTER_LR = 1.0
"""The benchmark's outer learning rate. With lr 1 and no momentum the outer step is the
sample-weighted mean of the members' parameters. DiLoCo's published Nesterov SGD (lr 0.7,
momentum 0.9) is tuned for phases of hundreds of inner steps; with this model's 32 it
overshoots (one device's held-out loss stalls near 1.95 against 0.59 without local steps)."""
OUTER_MOMENTUM = 0.0
"""The benchmark's outer momentum (see :data:`OUTER_LR`)."""
GOAL_SPEEDUP = 2.5
"""Goal: 4 devices at 20 Mbit/s in local-int8 reach the target this many times faster than one."""
GOAL_BYTES_RATIO = 100.0
"""Goal: local-int8 sends this many times fewer bytes per sample than sync."""
GOAL_UTILISATION = 0.9
"""Goal: local-int8's devices compute this share of the wall time (median over devices)."""
GOAL_FINAL_LOSS = 0.03
"""Goal: GPT's loss at the sample budget in local-int8 is within this share of sync's."""
GOAL_STRAGGLER = 0.15
"""Goal: local mode with one slow device reaches the target within this share of the time the
same cluster takes without it."""
GOAL_DEVICES, GOAL_MBIT = 4, 20.0
SLOW = "+slow"
"""The suffix of a run whose last device is ``slow_factor`` times slower."""


@dataclass(frozen=True)
class TrainBenchConfig:
    """One benchmark invocation.

    Args:
        model: ``gpt`` or ``cnn`` (:data:`chaos.emulate.train_models.MODELS`).
        modes: Modes to run (``single`` once per repeat: it has no network).
        devices: Device counts (a count of 1 runs the Chaos modes once, unshaped).
        mbits: Link rates in Mbit/s, each device's link to the hub, both ways.
        latency_ms: One-way delay between two devices (each of the two links adds half).
        samples: The cluster-wide sample budget of every run (``None``: the model's default).
        target_loss: The held-out loss to reach (``None``: the model's default).
        repeats: Runs of every case; figures are medians.
        cpu_per_device: Each device's cgroup CPU quota, in cores.
        max_wall_s: A run stops here even short of its budget (seconds after its start).
        inner_steps: LocalSteps' ``inner_steps`` (H).
        inner_time_s: LocalSteps' ``inner_time_s`` (``None``: none).
        overlap: ``LocalSteps(overlap=True)``: the outer step beside the next inner phase.
        outer_lr: The outer optimizer's learning rate (SGD on the averaged pseudo-gradient).
        outer_momentum: Its momentum (Nesterov's when above 0).
        slow_factor: With a value above 1, local runs of several devices are also run with the
            last device that many times slower (``local+slow``).
        eval_points: About how many evaluations a sync or single run makes.
        seed: The run's seed (the model's initialisation, the devices' batches).
        start_timeout_s: The longest the devices may take to start and join.

    Raises:
        ConfigError: a value out of range, with the option's name.
    """

    model: str = "gpt"
    modes: tuple[str, ...] = MODES
    devices: tuple[int, ...] = (1, 2, 4)
    mbits: tuple[float, ...] = (10.0, 20.0, 50.0)
    latency_ms: float = 20.0
    samples: int | None = None
    target_loss: float | None = None
    repeats: int = 3
    cpu_per_device: float = 0.45
    max_wall_s: float = 300.0
    inner_steps: int = 32
    inner_time_s: float | None = None
    overlap: bool = False
    outer_lr: float = OUTER_LR
    outer_momentum: float = OUTER_MOMENTUM
    slow_factor: float = 1.0
    eval_points: int = 12
    seed: int = 0
    start_timeout_s: float = 240.0

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ConfigError(f"--model must be one of {sorted(MODELS)}, got {self.model!r}")
        bad = [m for m in self.modes if m not in MODES]
        if not self.modes or bad or len(set(self.modes)) != len(self.modes):
            raise ConfigError(f"--modes must be distinct names of {', '.join(MODES)}; "
                              f"got {','.join(self.modes) or 'none'}")  # fmt: skip
        if not self.devices or any(not 1 <= n <= 8 for n in self.devices):
            raise ConfigError(f"--devices must be counts in [1, 8], got {self.devices}")
        if not self.mbits or any(not 0.1 <= b <= 10_000 for b in self.mbits):
            raise ConfigError(f"--mbit must be rates in [0.1, 10000] Mbit/s, got {self.mbits}")
        _check("--latency-ms", self.latency_ms, 0.0, 2000.0)
        if self.samples is not None and self.samples < 1:
            raise ConfigError(f"--samples must be at least 1, got {self.samples}")
        if self.target_loss is not None:
            _check("--target-loss", self.target_loss, 0.0, 100.0, low_open=True)
        if not 1 <= self.repeats <= 50 or not 1 <= self.inner_steps <= 100_000:
            raise ConfigError("--repeats must be in [1, 50] and --inner-steps in [1, 100000]")
        _check("--cpu-per-device", self.cpu_per_device, 0.01, 64.0)
        _check("--max-wall-s", self.max_wall_s, 1.0, 86_400.0)
        if self.inner_time_s is not None:
            _check("--inner-time-s", self.inner_time_s, 0.0, 3600.0, low_open=True)
        _check("--slow-device", self.slow_factor, 1.0, 100.0)
        _check("--outer-lr", self.outer_lr, 0.0, 10.0, low_open=True)
        _check("--outer-momentum", self.outer_momentum, 0.0, 0.99)
        if not 1 <= self.eval_points <= 1000:
            raise ConfigError(f"--eval-points must be in [1, 1000], got {self.eval_points}")
        _check("start_timeout_s", self.start_timeout_s, 1.0, 3600.0)

    @property
    def budget(self) -> int:
        """The cluster-wide sample budget."""
        return self.samples if self.samples is not None else DEFAULT_SAMPLES[self.model]

    @property
    def target(self) -> float:
        """The target loss."""
        return self.target_loss if self.target_loss is not None else MODELS[self.model].target_loss

    @property
    def eval_every_samples(self) -> int:
        """The cluster samples between two evaluations of a sync or single run."""
        return max(1, self.budget // self.eval_points)

    def cases(self) -> list[tuple[str, int, float | None]]:
        """Every case of one repeat: ``(mode, devices, mbit)``; ``single`` once with no rate, a
        Chaos mode on one device once with no rate, a ``local+slow`` case beside each local
        case of several devices when ``slow_factor`` is above 1."""
        out: list[tuple[str, int, float | None]] = []
        if "single" in self.modes:
            out.append(("single", 1, None))
        for mode in (m for m in self.modes if m != "single"):
            for n in self.devices:
                rates: Sequence[float | None] = [None] if n == 1 else self.mbits
                for mbit in rates:
                    out.append((mode, n, mbit))
                    if n > 1 and mode.startswith("local") and self.slow_factor > 1:
                        out.append((mode + SLOW, n, mbit))
        return out


def _check(name: str, value: float, low: float, high: float, *, low_open: bool = False) -> None:
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and math.isfinite(value) and low <= value <= high
          and not (low_open and value == low))  # fmt: skip
    if not ok:
        raise ConfigError(f"{name} must be a number in {'(' if low_open else '['}{low:g}, "
                          f"{high:g}], got {value!r}")  # fmt: skip


# ----------------------------------------------------------------------------- one run


def cluster_samples(progress: Sequence[dict[int, int]], step: int) -> int:
    """The cluster's samples at (outer) step ``step``: each device's own samples at its latest
    recorded step at or below it, summed.

    Args:
        progress: Per device, its samples by the step it recorded them at.
        step: The step.
    """
    total = 0
    for by_step in progress:
        steps = [s for s in by_step if s <= step]
        total += by_step[max(steps)] if steps else 0
    return total


def time_to_target(curve: Sequence[dict[str, float]], target: float) -> float | None:
    """The wall seconds of the first evaluation at or below ``target`` (``None``: never)."""
    for point in curve:
        if point["loss"] <= target:
            return point["wall_s"]
    return None


def loss_at_samples(curve: Sequence[dict[str, float]], samples: float) -> float | None:
    """The held-out loss at ``samples`` cluster samples, interpolated linearly between the two
    evaluations around it; past the last one, the last one's (``None``: no evaluation)."""
    if not curve:
        return None
    points = sorted(curve, key=lambda p: p["samples"])
    if samples <= points[0]["samples"]:
        return points[0]["loss"]
    for a, b in zip(points, points[1:], strict=False):
        if a["samples"] <= samples <= b["samples"]:
            span = b["samples"] - a["samples"]
            if span == 0:
                return b["loss"]
            return a["loss"] + (b["loss"] - a["loss"]) * (samples - a["samples"]) / span
    return points[-1]["loss"]


def run_figures(records: Sequence[Sequence[dict[str, Any]]], target: float,
                budget: int) -> dict[str, Any]:  # fmt: skip
    """A run's curve and figures from its devices' records (device 0 first).

    Returns:
        ``curve`` (wall_s, samples, loss per evaluation), ``time_to_target_s``,
        ``final_loss`` (at the budget), ``samples`` (the cluster's, at the last evaluation),
        ``utilisation`` (median over devices of compute over wall time) and
        ``utilisation_by_device``.
    """
    progress = [{int(r["step"]): int(r["samples"]) for r in recs if r.get("kind") == "progress"}
                for recs in records]  # fmt: skip
    curve = []
    for r in (r for r in records[0] if r.get("kind") == "eval"):
        others = cluster_samples(progress[1:], int(r["step"]))
        curve.append({"wall_s": float(r["wall_s"]), "samples": int(r["own_samples"]) + others,
                      "loss": float(r["loss"]), "step": int(r["step"])})  # fmt: skip
    util = []
    for recs in records:
        last = [r for r in recs if r.get("kind") in ("progress", "done")]
        if last and last[-1]["wall_s"] > 0:
            util.append(min(1.0, last[-1]["compute_s"] / last[-1]["wall_s"]))
    return {
        "curve": curve, "time_to_target_s": time_to_target(curve, target),
        "final_loss": loss_at_samples(curve, budget),
        "samples": curve[-1]["samples"] if curve else 0,
        "utilisation": statistics.median(util) if util else None,
        "utilisation_by_device": util,
    }  # fmt: skip


# ----------------------------------------------------------------------------- medians, goals


def _median(values: Sequence[float | None], missing_is_inf: bool = False) -> float | None:
    """The median over repeats. With ``missing_is_inf`` a ``None`` (a run that never reached
    the target) counts as slower than every run that did, and a median among them is
    ``None``; otherwise ``None`` values are left out."""
    if missing_is_inf:
        m = statistics.median([math.inf if v is None else v for v in values]) if values else None
        return None if m is None or math.isinf(m) else m
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The medians over repeats of every case, with the speed-up against ``single``.

    Args:
        runs: Every run: ``mode``, ``devices``, ``mbit`` and :func:`run_figures`' fields,
            with ``bytes_per_sample``.
    """
    keys: list[tuple[str, int, float | None]] = []
    for r in runs:
        k = (r["mode"], r["devices"], r["mbit"])
        if k not in keys:
            keys.append(k)
    rows = []
    for mode, n, mbit in keys:
        same = [r for r in runs if (r["mode"], r["devices"], r["mbit"]) == (mode, n, mbit)]
        row: dict[str, Any] = {"mode": mode, "devices": n, "mbit": mbit, "runs": len(same)}
        for fig in ("time_to_target_s", "final_loss", "bytes_per_sample", "utilisation"):
            row[fig] = _median([r.get(fig) for r in same], fig == "time_to_target_s")
        row["samples"] = min((int(r.get("samples") or 0) for r in same), default=0)
        rows.append(row)
    single = next((r["time_to_target_s"] for r in rows if r["mode"] == "single"), None)
    for row in rows:
        ttt = row["time_to_target_s"]
        row["speedup"] = single / ttt if single is not None and ttt else None
    return rows


def _find(
    rows: Sequence[dict[str, Any]], mode: str, n: int, mbit: float | None
) -> dict[str, Any] | None:
    return next((r for r in rows if (r["mode"], r["devices"], r["mbit"]) == (mode, n, mbit)),
                None)  # fmt: skip


def _verdict(name: str, value: float | None, ok: bool | None, detail: str) -> dict[str, Any]:
    status = "n/a" if ok is None else ("PASS" if ok else "FAIL")
    return {"goal": name, "value": value, "status": status, "detail": detail}


def goals(rows: Sequence[dict[str, Any]], model: str, n: int = GOAL_DEVICES,
          mbit: float = GOAL_MBIT, budget: int | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """The goals' verdicts (PASS, FAIL, or n/a when a case they need was not run or a figure
    is missing) at ``n`` devices and ``mbit`` Mbit/s. With ``budget`` (the runs' sample
    budget), the final-loss goal is n/a when a sync run stopped short of it (``max_wall_s``):
    its last loss is then not a loss at equal samples."""
    li = _find(rows, "local-int8", n, mbit)
    sync = _find(rows, "sync", n, mbit)
    out = []
    where = f"{n} devices, {mbit:g} Mbit/s"
    sp = li.get("speedup") if li else None
    out.append(_verdict("speed-up", sp, None if li is None or _find(rows, "single", 1, None)
                        is None else sp is not None and sp >= GOAL_SPEEDUP,  # fmt: skip
                        f"local-int8 at {where} reaches the target >= {GOAL_SPEEDUP}x faster "
                        "than single"))  # fmt: skip
    ratio = None
    if li and sync and li["bytes_per_sample"] and sync["bytes_per_sample"]:
        ratio = sync["bytes_per_sample"] / li["bytes_per_sample"]
    out.append(_verdict("bytes/sample", ratio, None if ratio is None else
                        ratio >= GOAL_BYTES_RATIO,  # fmt: skip
                        f"local-int8 sends >= {GOAL_BYTES_RATIO:g}x fewer bytes per sample than "
                        f"sync at {where}"))  # fmt: skip
    util = li.get("utilisation") if li else None
    out.append(_verdict("utilisation", util, None if util is None else util >= GOAL_UTILISATION,
                        f"local-int8's devices compute >= {GOAL_UTILISATION} of the wall time "
                        f"at {where}"))  # fmt: skip
    gap, short = None, ""
    if model == "gpt" and li and sync and li["final_loss"] and sync["final_loss"]:
        if budget is not None and sync.get("samples", budget) < 0.95 * budget:
            short = (f"; n/a: sync stopped at {sync['samples']} of {budget} samples "
                     "(max_wall_s), so its loss is not at equal samples")  # fmt: skip
        else:
            gap = li["final_loss"] / sync["final_loss"] - 1
    out.append(_verdict("final loss", gap, None if gap is None else gap <= GOAL_FINAL_LOSS,
                        f"GPT's loss at the sample budget in local-int8 within "
                        f"{GOAL_FINAL_LOSS:.0%} of sync's at {where}{short}"))  # fmt: skip
    out.append(_straggler(rows, n, mbit))
    return out


def _straggler(rows: Sequence[dict[str, Any]], n: int, mbit: float) -> dict[str, Any]:
    """The straggler goal: ``n`` devices in local mode, one of them slow, against the same
    cluster without that device (``n - 1`` devices at full speed)."""
    for mode in ("local", "local-int8"):
        base, slow = _find(rows, mode, n - 1, mbit), _find(rows, mode + SLOW, n, mbit)
        if base and slow:
            a, b = base["time_to_target_s"], slow["time_to_target_s"]
            extra = None if a is None or b is None else b / a - 1
            ok = False if b is None and a is not None else (
                None if extra is None else extra <= GOAL_STRAGGLER)  # fmt: skip
            return _verdict("straggler", extra, ok,
                            f"{mode} on {n} devices, one slow, reaches the target within "
                            f"{GOAL_STRAGGLER:.0%} of the time {n - 1} devices take without "
                            f"it ({mbit:g} Mbit/s)")  # fmt: skip
    return _verdict("straggler", None, None, "needs --slow-device, a local mode at "
                    f"{n} and {n - 1} devices, {mbit:g} Mbit/s")  # fmt: skip


# ----------------------------------------------------------------------------- the report


def _fmt(v: float | None, spec: str, unit: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{unit}"


def table(rows: Sequence[dict[str, Any]], verdicts: Sequence[dict[str, Any]]) -> list[str]:
    """The table's lines and the goals' lines."""
    lines = [f"{'mode':<16} {'N':>2} {'Mbit/s':>6} {'to target':>10} {'speed-up':>8} "
             f"{'bytes/sample':>12} {'util':>5} {'final loss':>10}"]  # fmt: skip
    for r in rows:
        lines.append(f"{r['mode']:<16} {r['devices']:>2} {_fmt(r['mbit'], 'g'):>6} "
                     f"{_fmt(r['time_to_target_s'], '.1f', ' s'):>10} "
                     f"{_fmt(r['speedup'], '.2f', 'x'):>8} "
                     f"{_fmt(r['bytes_per_sample'], ',.0f'):>12} "
                     f"{_fmt(r['utilisation'], '.2f'):>5} {_fmt(r['final_loss'], '.4f'):>10}")
    lines.append("")
    for v in verdicts:
        val = _fmt(v["value"], ".3g")
        lines.append(f"goal {v['goal']:<13} {v['status']:<4} (value {val}): {v['detail']}")
    return lines


def plot(runs: Sequence[dict[str, Any]], path: Path) -> None:
    """Loss against wall time and against cluster samples, one line per run (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    colours: dict[str, Any] = {}
    for r in runs:
        label = f"{r['mode']} n={r['devices']}" + (f" {r['mbit']:g}Mb" if r["mbit"] else "")
        c = colours.setdefault(label, f"C{len(colours) % 10}")
        xs = [p["wall_s"] for p in r["curve"]]
        ss = [p["samples"] for p in r["curve"]]
        ys = [p["loss"] for p in r["curve"]]
        show = label if r.get("repeat", 0) == 0 else None
        ax1.plot(xs, ys, color=c, label=show, lw=1)
        ax2.plot(ss, ys, color=c, label=show, lw=1)
    for ax, xl in ((ax1, "wall time (s, evaluations excluded)"), (ax2, "cluster samples")):
        ax.set_xlabel(xl)
        ax.set_ylabel("held-out loss")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
