"""``compare --rejoin`` on real devices (loopback): what a returning and a fresh device pull.

Each run starts real trainers with their embedded daemons on loopback: two devices, a third
that joins, leaves with its state, comes back with it and joins again. The runner reaps every
process when the run ends or fails; the test then checks that none of them is left.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil

from chaos.emulate.rejoin import FRESH, FRESH_NO_BASE, RETURN, rejoin_runs
from chaos.emulate.scenario import Scenario

SCALE = 0.004  # gpt2-lora: a 2 MB state (its base), resnet101: 1.4 MB


def _leftovers(folder: Path) -> list[psutil.Process]:
    """Processes whose command line names ``folder`` (the run's devices and daemons)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(str(folder) in arg for arg in proc.info["cmdline"] or ()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _run(model: str, folder: Path) -> dict[str, dict[str, Any]]:
    base = Scenario(name="rejoin", nodes=2, model=model, scale=SCALE, settle_s=2.0)
    try:
        rows = rejoin_runs("chaos", 2, base, folder, False, 0, 3.0, lambda _msg: None)
    finally:
        left = _leftovers(folder)
        for proc in left:
            proc.kill()
        psutil.wait_procs(left, timeout=10)
    assert not left, f"processes left behind: {[p.pid for p in left]}"
    return {r["join"]: r for r in rows}


def test_a_returning_lora_device_pulls_little_and_a_fresh_one_all(tmp_path: Path) -> None:
    joins = _run("gpt2-lora", tmp_path / "lora")
    assert set(joins) == {FRESH, RETURN, FRESH_NO_BASE}
    back, fresh = joins[RETURN], joins[FRESH_NO_BASE]
    total = back["state_bytes"]
    assert total > 1_000_000 and fresh["state_bytes"] == total
    # it held the base and its last adapters: only what changed while it was away comes over
    assert back["pulled_bytes"] < 0.1 * total
    assert back["pulled_bytes"] + back["reused_bytes"] == total
    # a device without the base on disk holds nothing of the cluster's state
    assert fresh["pulled_bytes"] == total and fresh["reused_bytes"] == 0
    # a fresh device with the base on disk pulls only the adapters, like the returning one
    assert joins[FRESH]["pulled_bytes"] < 0.1 * total
    assert back["away_s"] == 3.0 and back["replication_s"] > 0
    assert back["consistency"]["steps_compared"] > 0
    assert back["consistency"]["mismatches"] == 0


def test_a_returning_full_fine_tune_pulls_everything_again(tmp_path: Path) -> None:
    joins = _run("resnet101", tmp_path / "full")
    assert set(joins) == {FRESH, RETURN}
    for kind in (FRESH, RETURN):
        row = joins[kind]
        # every chunk changed while it was away (the store drifts every step)
        assert row["pulled_bytes"] == row["state_bytes"] > 1_000_000
        assert row["reused_bytes"] == 0
    # the drift is the same on every member: they stay bitwise equal
    assert joins[RETURN]["consistency"]["mismatches"] == 0


def test_rejoin_refuses_stop_resume(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "chaos.emulate.cli", "compare", "--rejoin", "--loopback",
         "--strategies", "stop-resume", "--json", str(tmp_path / "x.json")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 2 and "stop-resume" in res.stderr
    assert not (tmp_path / "x.json").exists()


def test_the_json_of_a_rejoin_compare(tmp_path: Path) -> None:
    model = "gpt2-lora"
    out = tmp_path / "rejoin.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "chaos.emulate.cli", "compare", "--rejoin", "--loopback",
         "--model", model, "--sizes", "2-3", "--scale", str(SCALE), "--away", "2",
         "--settle", "1", "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        left = _leftovers(tmp_path)
        for p in left:
            p.kill()
        psutil.wait_procs(left, timeout=10)
    assert proc.returncode == 0, stderr[-3000:]
    assert not left
    doc = json.loads(out.read_text())
    assert doc["mode"] == "rejoin" and doc["model"] == model and doc["away_s"] == 2.0
    assert [r["join"] for r in doc["joins"]] == [FRESH, RETURN, FRESH_NO_BASE]
    summary = doc["summary"]["chaos"]
    assert summary[FRESH_NO_BASE]["pulled_share"] == 1.0
    assert summary[RETURN]["pulled_share"] < 0.1
    assert "pulled" in stdout and "return" in stdout
