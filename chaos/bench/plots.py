"""PNG plots for the benchmarks (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PLOT_LABELS = ("even", "single-source", "chaos-per-tensor", "chaos", "scan")


def plot_assign(result: dict[str, Any], path: Path) -> None:
    """Fig. 16 style: per model, each method's makespan over the proven optimum; and gap CDFs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in result["records"] if r["methods"]["milp"]["proven_optimal"]]
    models = sorted(
        {r["model"] for r in records}, key=lambda m: [r["model"] for r in records].index(m)
    )
    ratios: dict[str, dict[str, list[float]]] = {
        lab: {m: [] for m in models} for lab in PLOT_LABELS
    }
    for r in records:
        opt = r["methods"]["milp"]["makespan_s"]
        for lab in PLOT_LABELS:
            ratios[lab][r["model"]].append(r["methods"][lab]["makespan_s"] / opt)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(PLOT_LABELS)
    for k, lab in enumerate(PLOT_LABELS):
        means = [sum(v) / len(v) if v else 0.0 for v in ratios[lab].values()]
        ax1.bar([i + k * width for i in range(len(models))], means, width, label=lab)
    ax1.axhline(1.0, color="k", lw=0.8, ls="--", label="MILP optimum")
    ax1.set_xticks([i + 0.4 - width / 2 for i in range(len(models))], models, rotation=20)
    ax1.set_yscale("log")
    ax1.set_ylabel("makespan / proven optimum (mean)")
    ax1.set_title("Replication makespan by model")
    ax1.legend(fontsize=8)
    for lab in ("chaos", "chaos-per-tensor", "scan", "even"):
        gaps = sorted(
            100 * (r["methods"][lab]["makespan_s"] / r["methods"]["milp"]["makespan_s"] - 1)
            for r in records
        )
        ax2.plot(gaps, [(i + 1) / len(gaps) for i in range(len(gaps))], label=lab)
    ax2.set_xscale("symlog", linthresh=0.1)
    ax2.set_xlabel("gap to proven optimum (%)")
    ax2.set_ylabel("fraction of instances")
    ax2.set_title(f"Gap CDF over {len(records)} instances")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
