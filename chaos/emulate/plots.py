"""PNG plots of emulation runs, in the style of the paper's figures (matplotlib, Agg)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from chaos.emulate.fleet import RunResult  # noqa: E402

PAPER_SCALE_OUT = ("paper, Fig. 7 (full-scale links, GPUs): Pollux over 100 s; EDL+ above 10 s for "
                   "larger models;\nAutoscaling grows with the cluster; Chaos about 1 s, flat. "
                   "This run: links and state x scale.")  # fmt: skip
PAPER_IDLE = "paper, Fig. 10: cluster idle time Chaos under 10 s, EDL+ 50-100 s, Pollux over 1000 s"
PAPER_CONNECT = "paper, Fig. 9 and Table I: connect-link under 1 ms at every cluster size"


def _paper_note(fig: Any, text: str) -> None:
    """The paper's reported range, printed under the axes for comparison."""
    fig.text(0.01, 0.01, text, fontsize=6.5, color="dimgray", va="bottom", ha="left")
    fig.tight_layout(rect=(0, 0.07, 1, 1))


_STYLE = {"stop-resume": ("tab:red", "s"), "single-source": ("tab:orange", "^"),
          "multi-source": ("tab:purple", "v"), "even": ("tab:green", "D"),
          "chaos": ("tab:blue", "o")}  # fmt: skip


def plot_timeline(result: RunResult, path: Path) -> None:
    """Each device's step duration over time, with the timeline's events marked."""
    fig, ax = plt.subplots(figsize=(9, 4))
    t0 = result.started
    for node, recs in sorted(result.devices.items()):
        steps = [r for r in recs if r.get("kind") == "step"]
        if steps:
            ax.plot([r["t"] - t0 for r in steps], [r["dur_s"] * 1000 for r in steps],
                    lw=0.8, label=node)  # fmt: skip
    for ev in result.harness_events:
        if ev["kind"] not in ("cluster_up", "end"):
            ax.axvline(ev["t"] - t0, color="grey", ls=":", lw=0.8)
            ax.text(ev["t"] - t0, ax.get_ylim()[1] * 0.95, ev.get("label", ev["kind"]),
                    rotation=90, va="top", fontsize=7)  # fmt: skip
    ax.set_xlabel("time (s)")
    ax.set_ylabel("step duration (ms)")
    ax.set_yscale("log")
    ax.set_title(f"{result.scenario.name}: {result.network}")
    ax.legend(fontsize=6, ncol=4)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _series(
    runs: list[dict[str, Any]], strategy: str, metric: str
) -> tuple[list[str], list[float]]:
    keys = sorted({r["from_nodes"] for r in runs if r["strategy"] == strategy})
    xs, ys = [], []
    for k in keys:
        vals = [r[metric] for r in runs
                if r["strategy"] == strategy and r["from_nodes"] == k and r[metric] is not None]
        if vals:
            xs.append(f"{k}→{k + 1}")
            ys.append(statistics.median(vals))
    return xs, ys


Spread = tuple[int, float, float, float]
"""One point of a series: the cluster size before the join, and the median, minimum and maximum
of a metric over the repeats."""


def spread_by(runs: list[dict[str, Any]], group: str, metric: str) -> dict[str, list[Spread]]:
    """A metric's median, minimum and maximum over repeats, per group and cluster size.

    Args:
        runs: Compare rows (``compare --json``'s ``runs``), each with ``from_nodes``, the field
            ``group`` and the field ``metric``.
        group: The field that names a line of the plot: ``strategy`` or ``model``.
        metric: The measured field, e.g. ``replication_s`` or ``scale_out_s``.

    Returns:
        For each group, its points ``(from_nodes, median, min, max)`` by cluster size; rows whose
        metric is missing are left out, and a size without any value has no point.
    """
    vals: dict[str, dict[int, list[float]]] = {}
    for r in runs:
        if r.get(metric) is not None:
            vals.setdefault(r[group], {}).setdefault(r["from_nodes"], []).append(r[metric])
    return {
        g: [(k, statistics.median(v), min(v), max(v)) for k, v in sorted(per.items())]
        for g, per in sorted(vals.items())
    }


FIG15_STRATEGIES = ("even", "single-source", "multi-source", "chaos")
"""The replication strategies of Fig. 15; stop-resume pulls no state (its ``replication_s`` is
the checkpoint save and read), so it has no line there."""
PAPER_REPLICATION = ("paper, Fig. 15: the state replication delay of one join under "
                     "single-source, multi-source and multi-neighbor (Chaos) replication.\nThis "
                     "run: links and state x scale; even: an equal split over the joiner's "
                     "neighbours.")  # fmt: skip
PAPER_MODELS = ("paper, Fig. 8: scale-out delay of Chaos grows linearly with the GPT-2 model's "
                "size and stays stable as the cluster grows.\nThis run: links and state x scale.")


def _plot_spread(ax: Any, points: dict[str, list[Spread]], styles: dict[str, Any]) -> None:
    """One line per group through the medians, with min-max error bars."""
    for g, pts in points.items():
        color, marker = styles.get(g, (None, "o"))
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], color=color, marker=marker,
                    capsize=3, label=g, yerr=[[p[1] - p[2] for p in pts],
                                              [p[3] - p[1] for p in pts]])  # fmt: skip
    sizes = sorted({p[0] for pts in points.values() for p in pts})
    ax.set_xticks(sizes, [f"{k}→{k + 1}" for k in sizes])
    ax.set_xlabel("cluster size (join)")


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_replication(runs: list[dict[str, Any]], path: Path) -> Path:
    """Fig. 15: the state replication delay per strategy against the cluster size (medians over
    repeats, min-max error bars); stop-resume and other strategies are left out.

    Args:
        runs: Compare rows (``compare --json``'s ``runs``).
        path: The PNG to write.

    Returns:
        ``path``.
    """
    rows = [r for r in runs if r["strategy"] in FIG15_STRATEGIES]
    points = spread_by(rows, "strategy", "replication_s")
    points = {s: points[s] for s in FIG15_STRATEGIES if s in points}
    fig, ax = plt.subplots(figsize=(7, 4))
    _plot_spread(ax, points, _STYLE)
    ax.set_ylabel("state replication delay (s, median)")
    ax.set_ylim(bottom=0)
    model = rows[0]["model"] if rows else "?"
    ax.set_title(f"state replication delay per strategy ({model})")
    ax.legend()
    _paper_note(fig, PAPER_REPLICATION)
    return _save(fig, path)


def plot_models(docs: list[dict[str, Any]], path: Path, strategy: str = "chaos") -> Path:
    """Fig. 8: the scale-out delay per model against the cluster size, one line per model
    (medians over repeats, min-max error bars), from several ``compare --json`` documents.

    Args:
        docs: ``compare`` JSON documents, one model each (rows of another strategy are left out).
        path: The PNG to write.
        strategy: The strategy whose rows are plotted.

    Returns:
        ``path``.
    """
    rows = [r for d in docs for r in d["runs"] if r["strategy"] == strategy]
    points = spread_by(rows, "model", "scale_out_s")
    state = {r["model"]: r["state_bytes"] for r in rows if r.get("state_bytes")}
    scale = {r["model"]: d.get("scale") for d in docs for r in d["runs"]}
    points = dict(sorted(points.items(), key=lambda kv: state.get(kv[0], 0)))
    fig, ax = plt.subplots(figsize=(7, 4))
    _plot_spread(ax, {f"{m}: state {state.get(m, 0) / 2**20:.1f} MiB (x{scale.get(m)})": p
                      for m, p in points.items()}, {})  # fmt: skip
    ax.set_ylabel("scale-out delay (s, median)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{strategy}: scale-out delay per model")
    ax.legend(fontsize=8)
    _paper_note(fig, PAPER_MODELS)
    return _save(fig, path)


def _plot_lower_bound(runs: list[dict[str, Any]], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4))
    for metric, style in (("replication_s", "-o"), ("lower_bound_s", "--"), ("idle_s", ":s")):
        xs, ys = _series(runs, "chaos", metric)
        ax.plot(xs, ys, style, label=f"chaos {metric[:-2].replace('_', ' ')}")
    ax.set_xlabel("cluster size")
    ax.set_ylabel("seconds (median)")
    ax.set_title("chaos replication vs its lower bound, and cluster idle time")
    ax.legend()
    _paper_note(fig, PAPER_IDLE)
    return _save(fig, path)


def plot_compare(
    runs: list[dict[str, Any]], out_dir: Path, links: list[dict[str, Any]] | None = None
) -> list[Path]:
    """``compare --plot``'s figures: Fig. 7/10-style scale-out delay per strategy
    (``compare_scale_out.png``), Fig. 15's replication delay per strategy
    (``compare_replication.png``), chaos's replication vs its lower bound and the idle time
    (``compare_lower_bound.png``), and Fig. 9-style connect-link delay as the cluster grows
    (``compare_connect_link.png``, with ``links`` only).

    Args:
        runs: Compare rows (``compare --json``'s ``runs``).
        out_dir: The folder to write the PNGs into.
        links: The connect-link rows (``connect_link``), if any.

    Returns:
        The paths written.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for strategy in sorted({r["strategy"] for r in runs}):
        xs, ys = _series(runs, strategy, "scale_out_s")
        color, marker = _STYLE.get(strategy, ("black", "x"))
        ax.plot(xs, ys, marker=marker, color=color, label=strategy)
    ax.set_yscale("log")
    ax.set_xlabel("cluster size")
    ax.set_ylabel("scale-out delay (s, median)")
    ax.set_title(f"scale-out delay ({runs[0]['model']}, network: {runs[0]['network']})")
    ax.legend()
    _paper_note(fig, PAPER_SCALE_OUT)
    paths.append(_save(fig, out_dir / "compare_scale_out.png"))
    if any(r["strategy"] in FIG15_STRATEGIES for r in runs):
        paths.append(plot_replication(runs, out_dir / "compare_replication.png"))
    if any(r["strategy"] == "chaos" for r in runs):
        paths.append(_plot_lower_bound(runs, out_dir / "compare_lower_bound.png"))
    if links:
        fig, ax = plt.subplots(figsize=(7, 4))
        for metric, style in (("control_s", "-o"), ("stall_s", "--s")):
            pts = sorted((r["nodes"], r[metric]) for r in links if r[metric] is not None)
            ax.plot([p[0] for p in pts], [p[1] * 1000 for p in pts], style,
                    label=metric[:-2].replace("_", " "))  # fmt: skip
        ax.set_xlabel("cluster size")
        ax.set_ylabel("ms")
        ax.set_title("connect-link: control path and training-step stall")
        ax.legend()
        _paper_note(fig, PAPER_CONNECT)
        paths.append(_save(fig, out_dir / "compare_connect_link.png"))
    return paths


_EVENT_COLORS = {"join": "tab:green", "leave": "tab:olive", "kill": "tab:red",
                 "link_cut": "tab:orange", "partition": "tab:purple", "heal": "tab:blue",
                 "crash": "black", "join_failed": "dimgray",
                 "leave_timeout": "black"}  # fmt: skip


def plot_campaign(doc: dict[str, Any], path: Path, bin_s: float = 5.0) -> Path:
    """A fault campaign's timeline: steps per second of the cluster's history and the number
    of running and training devices, with every event as a coloured vertical mark.

    Args:
        doc: The campaign's JSON document (:func:`chaos.emulate.campaign.report`).
        path: The PNG to write.
        bin_s: Width of the steps-per-second bins.

    Returns:
        ``path``.
    """
    t0 = doc["started"]
    end = doc["ended"] - t0
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    nbins = max(1, int(end // bin_s) + 1)
    counts = [0] * nbins
    for t, _step in doc["timeline"]["lineage"]:
        i = int((t - t0) // bin_s)
        if 0 <= i < nbins:
            counts[i] += 1
    ax1.step([i * bin_s for i in range(nbins)], [c / bin_s for c in counts], where="post",
             lw=0.9, color="tab:blue")  # fmt: skip
    ax1.set_ylabel("steps / s (history)")
    members = [(t - t0, w) for t, w in doc["timeline"]["members"] if t >= t0]
    if members:
        ax2.plot([m[0] for m in members], [m[1] for m in members], ".", ms=1.5,
                 color="tab:gray", label="world of each step")  # fmt: skip
    live: list[tuple[float, int]] = []
    n = doc["config"]["nodes"]
    for ev in doc["harness_events"]:
        if ev["t"] < t0:
            continue
        if ev["kind"] == "join":
            n += 1
        elif ev["kind"] in ("kill", "leave", "crash", "join_failed"):
            n -= 1
        live.append((ev["t"] - t0, n))
    if live:
        ax2.step([0.0] + [x[0] for x in live], [doc["config"]["nodes"]] + [x[1] for x in live],
                 where="post", color="tab:green", lw=1.0, label="running devices")  # fmt: skip
    ax2.set_ylabel("devices")
    ax2.set_xlabel("time since the cluster was up (s)")
    seen: set[str] = set()
    for ev in doc["harness_events"]:
        color = _EVENT_COLORS.get(ev["kind"])
        if color is None or ev["t"] < t0:
            continue
        for ax in (ax1, ax2):
            ax.axvline(ev["t"] - t0, color=color, lw=0.5, alpha=0.6,
                       label=ev["kind"] if ax is ax1 and ev["kind"] not in seen else None)
        seen.add(ev["kind"])
    ax1.legend(fontsize=6, ncol=8, loc="upper right")
    ax2.legend(fontsize=6, loc="lower right")
    e = doc["ettr"]["ettr"]
    ax1.set_title(f"fault campaign ({doc['network']}): {doc['injected_faults']} faults, "
                  f"ETTR {e:.3f}" if e is not None else "fault campaign")  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
