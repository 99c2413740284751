"""The benchmarks run as real processes and write the JSON their docs promise."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

BENCH = [sys.executable, "-m", "chaos.bench.cli"]


def _run(args: list[str], timeout_s: float = 300.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(BENCH + args, capture_output=True, text=True, timeout=timeout_s)


def test_assign_writes_schema(tmp_path: Path) -> None:
    out = tmp_path / "assign.json"
    png = tmp_path / "assign.png"
    proc = _run(
        [
            "assign",
            "--instances",
            "3",
            "--seed",
            "7",
            "--models",
            "alexnet,gpt2-lora",
            "--json",
            str(out),
            "--plot",
            str(png),
        ]
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["instances"] == 3
    assert 0.0 <= data["optimum_proven"] <= 1.0
    expected = {"chaos", "chaos-per-tensor", "scan", "even", "single-source", "milp"}
    assert set(data["methods"]) == expected
    for row in data["methods"].values():
        assert set(row) == {"gap_mean", "gap_max", "solve_ms_p50", "solve_ms_p99"}
    if data["optimum_proven"] > 0:
        # The MILP optimum is the reference, and nothing beats it in the flat layout by more
        # than CBC's tolerance.
        assert abs(data["methods"]["milp"]["gap_mean"]) < 1e-6
        assert data["methods"]["scan"]["gap_max"] > -1e-6
        assert data["methods"]["even"]["gap_mean"] >= data["methods"]["scan"]["gap_mean"]
    assert png.stat().st_size > 0
    assert "gap mean" in proc.stdout


def test_assign_rejects_unknown_model(tmp_path: Path) -> None:
    proc = _run(["assign", "--instances", "1", "--models", "resnet9000"])
    assert proc.returncode != 0
    assert "unknown models" in proc.stderr


def test_shard_cost_fits_a_finite_cost(tmp_path: Path) -> None:
    out = tmp_path / "c.json"
    proc = _run(["shard-cost", "--payload-mb", "2", "--repeats", "1", "--json", str(out)])
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert math.isfinite(data["per_shard_cost_s"])
    assert set(data["median_s_by_messages"]) == {"1", "16", "64", "256", "1024", "4096"}
