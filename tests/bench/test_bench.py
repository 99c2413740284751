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


def test_control_writes_schema(tmp_path: Path) -> None:
    """``chaos-bench control`` with real daemons, tiny settings: the JSON keys of docs/daemon.md,
    plus the client round trip and the scheduler-side figures. No timing is asserted."""
    import os
    import signal

    out = tmp_path / "control.json"
    args = ["control", "--nodes", "3", "--repeats", "2", "--scale-ins", "1", "--kills", "1"]
    args += ["--reelections", "1", "--idle-s", "1", "--json", str(out)]
    # its own process group, so a hung run's daemons are reaped with it
    proc = subprocess.Popen(
        BENCH + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stdout
    data = json.loads(out.read_text())
    for key, n in (("scale_in_ms", 1), ("connect_link_ms", 2), ("disconnect_link_ms", 2)):
        assert data[key]["n"] == n and 0 < data[key]["p50"] <= data[key]["p99"]
        prim = key.removesuffix("_ms")
        rtt, sched = data["client_round_trip_ms"][prim], data["scheduler_side_ms"][prim]
        # completion ends at the scheduler's log line, which the answer's way back follows
        assert sched["n"] == rtt["n"] == n and sched["p50"] > 0
    for key in ("failure_detection_s", "reelection_s"):
        assert data[key]["n"] == 1 and data[key]["p50"] > 0
    assert 0 <= data["idle_cpu_percent"] <= data["idle_cpu_percent_max"]
    # one CPU figure per link primitive run (a window's CPU less idle use may be slightly < 0)
    assert {k: v["n"] for k, v in data["cpu_ms"].items()} == {
        "connect_link": 2,
        "disconnect_link": 2,
    }
    for prim, split in data["cpu_split_ms"].items():
        assert set(split) == {"event_loop", "other_threads"}
        assert split["event_loop"]["n"] == split["other_threads"]["n"] == 2
        # the parts are of the same windows as the total: their samples add up to its samples
        for loop, other, total in zip(
            split["event_loop"]["samples"],
            split["other_threads"]["samples"],
            data["cpu_ms"][prim]["samples"],
            strict=True,
        ):
            assert math.isclose(loop + other, total, abs_tol=1e-5)
    assert data["cpu_window_s"] > 0
    assert "completion / client round trip / scheduler side" in stdout
    assert "control-plane CPU per connect_link" in stdout
