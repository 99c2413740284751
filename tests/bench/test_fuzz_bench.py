"""``chaos-bench fuzz`` against live processes: its JSON, its targets alive afterwards, and
every process it started reaped."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from chaos.bench.cli import main

_TARGETS = ("daemon", "shard_server", "trainer")
_KEYS = {
    "pid", "crashed", "alive", "answers", "crashed_at_frame", "frames_sent", "send_s",
    "frames_per_s", "frames_by_kind", "refusals", "replies", "send_timeouts", "rss_before_bytes",
    "rss_after_bytes", "rss_ratio", "rss_within_10pct", "last_frames_hex",
}  # fmt: skip


def test_a_small_run(tmp_path: Path) -> None:
    out = tmp_path / "fuzz.json"
    res = CliRunner().invoke(main, ["fuzz", "--frames", "300", "--json", str(out), "--seed", "3"])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["frames_per_target"] == 300 and data["seed"] == 3
    crashed = {k: v for k, v in data["targets"].items() if v["crashed"]}
    assert isinstance(data["crashes"], int) and data["crashes"] == 0, crashed
    assert data["reaped"] is True
    assert set(data["targets"]) == set(_TARGETS)
    for name in _TARGETS:
        t = data["targets"][name]
        assert _KEYS <= t.keys(), name
        assert t["frames_sent"] == 300
        assert t["alive"] and t["answers"] and not t["crashed"], name
        assert sum(t["frames_by_kind"].values()) == 300
        assert t["rss_before_bytes"] > 0 and t["rss_after_bytes"] > 0
        assert not psutil.pid_exists(t["pid"]) or psutil.Process(t["pid"]).status() == "zombie"
    # the msgpack targets answered bad frames with refusals that say why
    assert sum(data["targets"]["daemon"]["refusals"].values()) > 0
    assert "malformed" in data["targets"]["shard_server"]["refusals"]
    assert data["targets"]["trainer"]["rounds_during_run"] >= 0
    assert "crashes:" in res.output and "daemon" in res.output


@pytest.mark.parametrize("frames", ["0", "-5", "many"])
def test_frames_must_be_a_positive_integer(tmp_path: Path, frames: str) -> None:
    out = tmp_path / "fuzz.json"
    res = CliRunner().invoke(main, ["fuzz", "--frames", frames, "--json", str(out)])
    assert res.exit_code == 2
    assert "--frames" in res.output
    assert not out.exists()
