"""The PNGs of ``chaos-bench convergence`` (matplotlib, Agg backend).

Two figures, each with one column per batch mode and rows for test accuracy and test loss:
``convergence_step.png`` against steps and ``convergence_wall.png`` against seconds since the
first step. Each run kind is the median over its seeds at each evaluated step (its seconds too);
the static runs' spread (min..max over both static kinds and every seed) is shaded.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import numpy as np

METRICS = ("accuracy", "loss")


def _median_curve(runs: list[dict[str, Any]], x: str, metric: str) -> tuple[list[float], ...]:
    """Per evaluated step that every run reached: the medians of ``x`` and of ``metric``."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for r in runs:
        for point in r["series"]:
            by_step.setdefault(point["step"], []).append(point)
    steps = sorted(s for s, pts in by_step.items() if len(pts) == len(runs))
    xs = [statistics.median(p[x] for p in by_step[s]) for s in steps]
    ys = [statistics.median(p[metric] for p in by_step[s]) for s in steps]
    return xs, ys


def _band(runs: list[dict[str, Any]], x: str, metric: str) -> tuple[Any, Any, Any]:
    """The static runs' min..max of ``metric`` on a common grid of ``x``."""
    series = [([p[x] for p in r["series"]], [p[metric] for p in r["series"]]) for r in runs]
    end = min(xs[-1] for xs, _ in series)
    grid = np.linspace(0.0, end, 200)
    curves = np.array([np.interp(grid, xs, ys) for xs, ys in series])
    return grid, curves.min(axis=0), curves.max(axis=0)


def plot_convergence(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Writes ``convergence_step.png`` and ``convergence_wall.png`` under ``out_dir``.

    Args:
        result: What :func:`chaos.bench.convergence.run` returned.
        out_dir: The folder (created if missing).

    Returns:
        The files written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = result["config"]
    modes = [m for m in cfg["batch_modes"] if any(r["batch_mode"] == m for r in result["runs"])]
    statics = result["static_kinds"]
    written = []
    for x, label in (("step", "step"), ("wall_s", "seconds since the first step")):
        fig, axes = plt.subplots(2, len(modes), figsize=(6.5 * len(modes), 8), squeeze=False)
        for col, mode in enumerate(modes):
            ok = [r for r in result["runs"] if r["batch_mode"] == mode and r["ok"]]
            static = [r for r in ok if r["kind"] in statics]
            for row, metric in enumerate(METRICS):
                ax = axes[row][col]
                if static:
                    grid, lo, hi = _band(static, x, metric)
                    ax.fill_between(grid, lo, hi, color="0.85", label="static spread")
                for kind in cfg["kinds"]:
                    mine = [r for r in ok if r["kind"] == kind]
                    if mine:
                        xs, ys = _median_curve(mine, x, metric)
                        ax.plot(xs, ys, label=f"{kind} (median of {len(mine)})", lw=1.3)
                if metric == "accuracy":
                    ax.set_ylim(max(0.0, ax.get_ylim()[0]), 1.0)
                else:
                    ax.set_yscale("log")
                ax.set_xlabel(label)
                ax.set_ylabel(f"test {metric}")
                ax.set_title(f"{mode} batch: test {metric}")
                ax.grid(alpha=0.3)
                if ax.get_legend_handles_labels()[0]:
                    ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"convergence_{'step' if x == 'step' else 'wall'}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
