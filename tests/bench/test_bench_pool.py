"""``chaos-bench pool`` pools primitives runs: exact medians, an interval around them, clear errors.

The inputs are small JSON files in the shape ``chaos-bench primitives`` writes (its own test
checks that shape against a real run); the pooling is pure arithmetic, so synthetic samples let
the expected figures be worked out by hand.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from chaos.bench.pool import baseline_correlation, load_runs, per_run, pooled_added
from chaos.bench.primitives import PRIMITIVES
from chaos.errors import ConfigError


def _run(path: Path, stall: list[float], null: list[float]) -> Path:
    doc: dict[str, object] = {"null_ms": {}}
    for key in PRIMITIVES:
        doc[f"{key}_ms"] = {"p50": 0.0, "samples": stall}
        doc["null_ms"][key] = {"p50": 0.0, "samples": null}  # type: ignore[index]
    path.write_text(json.dumps(doc))
    return path


def test_pooling_takes_the_medians_of_all_runs_samples_together(tmp_path: Path) -> None:
    a = _run(tmp_path / "a.json", [1.0, 2.0, 9.0], [0.0, 1.0])
    b = _run(tmp_path / "b.json", [3.0, 4.0], [1.0, 2.0, 5.0])
    pooled = load_runs([a, b])
    stall, null = pooled["connect_link"]
    assert sorted(stall) == [1.0, 2.0, 3.0, 4.0, 9.0]
    assert sorted(null) == [0.0, 1.0, 1.0, 2.0, 5.0]
    r = pooled_added(stall, null)
    assert r["added_p50_ms"] == 3.0 - 1.0  # not the mean of the runs' own differences
    assert (r["n"], r["null_n"]) == (5, 5)
    low, high = r["ci90_ms"]
    assert low <= r["added_p50_ms"] <= high
    assert pooled_added(stall, null) == r  # seeded: the same files give the same interval


def test_a_constant_sample_set_gives_a_zero_width_interval() -> None:
    r = pooled_added([4.0] * 7, [1.5] * 9)
    assert r["added_p50_ms"] == 2.5
    assert r["ci90_ms"] == [2.5, 2.5]


def test_bad_inputs_are_refused_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no run"):
        load_runs([])
    with pytest.raises(ConfigError, match="cannot read"):
        load_runs([tmp_path / "missing.json"])
    (tmp_path / "other.json").write_text(json.dumps({"sizes": {}}))
    with pytest.raises(ConfigError, match="not a chaos-bench primitives JSON"):
        load_runs([tmp_path / "other.json"])
    bad = _run(tmp_path / "bad.json", [1.0], [0.0])
    doc = json.loads(bad.read_text())
    doc["scale_in_ms"]["samples"] = ["x"]
    bad.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="list of numbers"):
        load_runs([bad])
    with pytest.raises(ConfigError, match="at least one"):
        pooled_added([], [1.0])
    with pytest.raises(ConfigError, match="resamples"):
        pooled_added([1.0], [1.0], resamples=10)


def test_the_command_prints_a_table_and_writes_json(tmp_path: Path) -> None:
    a = _run(tmp_path / "a.json", [2.0, 3.0, 4.0], [1.0, 1.0, 1.0])
    out = tmp_path / "pooled.json"
    argv = [sys.executable, "-m", "chaos.bench.cli", "pool", str(a), "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "connect_link" in done.stdout and "+2.00" in done.stdout
    result = json.loads(out.read_text())
    assert result["runs"] == [str(a)]
    assert {k: result[k]["added_p50_ms"] for k in PRIMITIVES} == dict.fromkeys(PRIMITIVES, 2.0)
    assert result["per_run"][0]["baseline_step_ms"] is None  # the synthetic run has none
    assert result["baseline_correlation"] == dict.fromkeys(PRIMITIVES, None)  # one run only
    assert "a.json" in done.stdout and "correlation of baseline step" in done.stdout

    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    bad = subprocess.run(
        [sys.executable, "-m", "chaos.bench.cli", "pool", str(broken)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2
    assert "cannot read it as JSON" in bad.stderr


def _with_figures(path: Path, baseline: float | None, added: dict[str, float]) -> Path:
    _run(path, [1.0], [0.0])
    doc = json.loads(path.read_text())
    if baseline is not None:
        doc["baseline_step_ms"] = baseline
    doc["added_p50_ms"] = added
    path.write_text(json.dumps(doc))
    return path


def test_each_run_is_listed_with_its_baseline_step_and_added_stall(tmp_path: Path) -> None:
    a = _with_figures(tmp_path / "a.json", 25.5, {"scale_in": 0.1, "connect_link": 0.8})
    b = _with_figures(tmp_path / "b.json", None, {"connect_link": "x"})  # type: ignore[dict-item]
    rows = per_run([a, b])
    assert rows[0] == {
        "run": str(a),
        "baseline_step_ms": 25.5,
        "added_p50_ms": {"scale_in": 0.1, "connect_link": 0.8, "disconnect_link": None},
    }
    assert rows[1]["baseline_step_ms"] is None
    assert rows[1]["added_p50_ms"] == dict.fromkeys(PRIMITIVES, None)  # not a number: left out


def test_the_correlation_follows_the_runs_and_needs_three_of_them(tmp_path: Path) -> None:
    files = [
        _with_figures(
            tmp_path / f"r{i}.json",
            base,
            {"scale_in": 0.5, "connect_link": 2 * base - 50, "disconnect_link": 60 - 2 * base},
        )
        for i, base in enumerate([25.0, 26.0, 28.0])
    ]
    corr = baseline_correlation(per_run(files))
    assert corr["connect_link"] == pytest.approx(1.0)
    assert corr["disconnect_link"] == pytest.approx(-1.0)
    assert corr["scale_in"] is None  # constant: no correlation to speak of
    two = baseline_correlation(per_run(files[:2]))
    assert two == dict.fromkeys(PRIMITIVES, None)
