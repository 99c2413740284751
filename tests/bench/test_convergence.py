"""``chaos-bench convergence``: its config checks, its schedule and verdicts, and one tiny real
run (two devices and a join, real processes) whose JSON holds the series and whose loss falls.
No timing is asserted; every process the run starts is reaped, even when the test fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from chaos.bench.convergence import (
    ConvergenceConfig,
    convergence_command,
    schedule,
    summarize,
)
from chaos.errors import ConfigError
from chaos.launch import stop_tree

BENCH = [sys.executable, "-m", "chaos.bench.cli", "convergence"]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"devices": 1}, "devices must be 2-7"),
        ({"global_batch": 30}, "multiple of devices"),
        ({"devices": 4, "global_batch": 4}, "and above it"),
        ({"seeds": 0}, "seeds must be 1-20"),
        ({"steps": 5}, "steps"),
        ({"eval_every": 301}, "eval_every"),
        ({"lr": 0.0}, "lr and timeout_s must be positive"),
        ({"sample_s": -1.0}, "sample_s >= 0"),
        ({"kinds": ("static-3",)}, "kinds must be distinct, of static-4, static-5"),
        ({"kinds": ("churn", "churn")}, "kinds must be distinct"),
        ({"batch_modes": ("huge",)}, "batch_modes must be distinct"),
        ({"batch_modes": ()}, "batch_modes"),
    ],
)
def test_bad_config_is_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ConvergenceConfig(**fields)


def test_default_kinds_follow_the_devices() -> None:
    assert ConvergenceConfig().kinds == ("static-4", "static-5", "scale-out", "churn")
    assert ConvergenceConfig(devices=2, global_batch=8).kinds[:2] == ("static-2", "static-3")


def test_bad_cli_arguments_are_usage_errors(tmp_path: Path) -> None:
    out = str(tmp_path / "c.json")
    res = CliRunner().invoke(convergence_command, ["--kinds", "static-9", "--json", out])
    assert res.exit_code == 2
    assert "kinds must be distinct" in res.output
    res = CliRunner().invoke(convergence_command, ["--devices", "1", "--json", out])
    assert res.exit_code == 2
    assert not Path(out).exists()


def test_without_scikit_learn_it_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "sklearn", None)  # import sklearn now raises ImportError
    out = tmp_path / "c.json"
    res = CliRunner().invoke(convergence_command, ["--json", str(out)])
    assert res.exit_code == 1
    assert "pip install 'chaos-edge[examples]'" in res.output
    assert not out.exists()


def test_the_churn_schedule_joins_leaves_and_kills_members_not_the_founder() -> None:
    initial, changes = schedule(ConvergenceConfig(steps=100), "churn")
    assert initial == 4
    assert [(c.action, c.node, c.members_after) for c in changes] == [
        ("join", "n4", 5),
        ("leave", "n1", 4),
        ("join", "n5", 5),
        ("kill", "n2", 4),
    ]
    assert [c.at for c in changes] == sorted(c.at for c in changes)
    assert all(0 < c.at < 100 for c in changes)
    initial, changes = schedule(ConvergenceConfig(steps=100), "scale-out")
    assert (initial, [(c.action, c.members_after) for c in changes]) == (4, [("join", 5)])
    assert schedule(ConvergenceConfig(), "static-5") == (5, [])


def _run(kind: str, mode: str, seed: int, acc: float, loss: float, ok: bool = True) -> dict:
    final = {"step": 10, "wall_s": 1.0 + seed, "loss": loss, "accuracy": acc, "members": 4}
    return {"kind": kind, "batch_mode": mode, "seed": seed, "ok": ok,
            "final": final if ok else None}  # fmt: skip


def test_summary_spread_medians_and_verdicts() -> None:
    runs = [
        _run("static-4", "constant", 0, 0.90, 0.30),
        _run("static-5", "constant", 0, 0.94, 0.20),
        _run("scale-out", "constant", 0, 0.91, 0.25),
        _run("scale-out", "constant", 1, 0.99, 0.10),  # outside, but the median is inside
        _run("scale-out", "constant", 2, 0.92, 0.22),
        _run("churn", "constant", 0, 0.80, 0.50),
        _run("churn", "constant", 1, 0.0, 0.0, ok=False),
        _run("static-4", "per-device", 0, 0.90, 0.30),
        _run("scale-out", "per-device", 0, 0.95, 0.25),  # accuracy above the spread
    ]
    s = summarize(runs, devices=4)
    const = s["by_mode"]["constant"]
    assert const["spread"] == {"accuracy": [0.90, 0.94], "loss": [0.20, 0.30]}
    scale = const["kinds"]["scale-out"]
    assert (scale["runs"], scale["failed"], scale["seeds_inside"]) == (3, 0, 2)
    assert scale["accuracy_median"] == 0.92 and scale["loss_median"] == 0.22
    assert scale["inside"] is True
    churn = const["kinds"]["churn"]
    assert (churn["runs"], churn["failed"], churn["inside"]) == (1, 1, False)
    assert s["goal"] is False  # churn lies outside
    assert s["by_mode"]["per-device"]["kinds"]["scale-out"]["inside"] is False
    # without the churn, the goal is met; without static runs it cannot be judged
    assert summarize([r for r in runs if r["kind"] != "churn"], 4)["goal"] is True
    no_static = summarize([r for r in runs if not r["kind"].startswith("static")], 4)
    assert no_static["goal"] is None
    assert no_static["by_mode"]["constant"]["spread"] is None


def test_a_tiny_scale_out_run_trains_through_the_join(tmp_path: Path) -> None:
    out, plots = tmp_path / "conv.json", tmp_path / "plots"
    args = ["--devices", "2", "--global-batch", "16", "--kinds", "scale-out"]
    args += ["--batch-modes", "constant", "--seeds", "1", "--steps", "60", "--eval-every", "10"]
    args += ["--sample-time", "0.01", "--timeout", "90", "--work-dir", str(tmp_path / "w")]
    args += ["--json", str(out), "--plot", str(plots)]
    proc = subprocess.Popen(BENCH + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    try:
        text, _ = proc.communicate(timeout=300)
    finally:
        stop_tree(proc)  # a hung run's workers are reaped with it
    assert proc.returncode == 0, text
    data = json.loads(out.read_text())
    assert data["config"]["devices"] == 2
    (run,) = data["runs"]
    assert run["ok"] and run["error"] is None, run["error"]
    series = run["series"]
    assert [p["step"] for p in series] == list(range(0, 61, 10))
    assert {p["members"] for p in series} == {2, 3}  # before and after the join
    (join,) = run["changes"]
    assert join["action"] == "join" and join["effective_step"] >= join["at_step"] == 24
    assert series[-1]["loss"] < series[0]["loss"]
    assert all(0.0 <= p["accuracy"] <= 1.0 for p in series)
    assert [p["wall_s"] for p in series] == sorted(p["wall_s"] for p in series)
    assert run["final"] == series[-1]
    assert data["summary"]["goal"] is None  # no static run to compare with
    for name in ("convergence_step.png", "convergence_wall.png"):
        assert (plots / name).stat().st_size > 0
    assert "scale-out" in text
