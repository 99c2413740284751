"""The emulation harness's runs: scenario files, the metrics, and (as root) real clusters.

The end-to-end tests run ``chaos-emulate demo`` and ``chaos-emulate compare`` as real processes:
real daemons and trainers in network namespaces on tc-shaped links. They need root (CI runs as
root) and check that no namespace is left behind. The metric tests feed hand-written records to
the pure metric functions.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from chaos.emulate.fleet import RunResult
from chaos.emulate.metrics import consistency, failure_metrics, join_metrics, stall_metrics
from chaos.emulate.netns import list_namespaces
from chaos.emulate.scenario import Scenario, demo_scenario, load_scenario, scenario_from_dict
from chaos.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "scenarios"
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="runs devices in network namespaces on tc-shaped links: needs root and iproute2 "
    "(CI runs as root)",
)


# ------------------------------------------------------------------------------- scenarios


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.stem)
def test_example_scenarios_load(path: Path) -> None:
    sc = load_scenario(path)
    assert sc.events and len(sc.devices) >= sc.nodes


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ({"nodes": 0}, "nodes"),
        ({"strategy": "fastest"}, "strategy"),
        ({"model": "resnet9000"}, "model"),
        ({"colour": "red"}, "unknown scenario keys"),
        ({"events": [{"at_s": 1, "kind": "explode"}]}, "event kind"),
        ({"events": [{"at_s": 1, "kind": "kill", "node": "n9"}]}, "not running"),
        ({"events": [{"at_s": 1, "kind": "link_add", "a": "n0"}]}, "two distinct ends"),
        ({"events": [{"at_s": 1, "kind": "join", "when": 2}]}, "unknown event keys"),
        ({"bandwidth_mbps": [10]}, "bandwidth_mbps"),
        ({"scale": 2.0}, "scale"),
        ({"inner_steps": -1}, "inner_steps"),
        ({"inner_steps": 1.5}, "inner_steps"),
        ({"overlap": True}, "overlap"),
    ],
)
def test_bad_scenarios_are_refused_with_the_field_named(doc: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        scenario_from_dict(doc)


def test_unreadable_or_malformed_scenario_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_scenario(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("nodes = [")
    with pytest.raises(ConfigError, match="cannot read"):
        load_scenario(bad)


def test_poisson_joins_get_fresh_names_in_time_order() -> None:
    sc = scenario_from_dict({"nodes": 3, "seed": 4, "poisson": {"rate_per_s": 1.0, "until_s": 5}})
    joins = [e for e in sc.events if e.kind == "join"]
    assert joins, "a 1/s process over 5 s produced no join"
    assert [e.node for e in joins] == [f"n{3 + i}" for i in range(len(joins))]
    assert [e.at_s for e in joins] == sorted(e.at_s for e in joins)


def test_demo_scenario_has_every_primitive() -> None:
    kinds = {e.kind for e in demo_scenario(5).events}
    assert kinds == {"join", "leave", "kill", "link_add", "link_cut", "partition", "heal"}
    with pytest.raises(ConfigError):
        demo_scenario(3)


# ------------------------------------------------------------------------------- metrics


def _steps(t0: float, durs: list[float], epoch: int = 1, world: int = 3) -> list[dict]:
    out, t = [], t0
    for i, d in enumerate(durs):
        t += d
        out.append({"kind": "step", "t": t, "dur_s": d, "step": i, "epoch": epoch,
                    "world": world, "digest": f"d{i}"})  # fmt: skip
    return out


def test_join_metrics_sum_the_idle_time_of_the_other_devices() -> None:
    res = RunResult(Scenario(), "test", 0.0)
    # a steady 0.1 s step everywhere, except two 0.6 s steps on "a" and one on "b" at t ~ 10
    res.devices["a"] = _steps(0.0, [0.1] * 95 + [0.6, 0.6] + [0.1] * 50)
    res.devices["b"] = _steps(0.0, [0.1] * 96 + [0.6] + [0.1] * 50)
    res.daemon_events = [
        {"event": "scale_out_started", "peer": "j", "ts": 9.4},
        {"event": "scale_out_complete", "peer": "j", "ts": 11.0},
    ]
    res.devices["j"] = [{"kind": "ready", "t": 11.0, "events": [
        {"event": "replication_done", "elapsed_s": 0.8, "lower_bound_s": 0.7, "bytes": 10}]}]
    ev = {"kind": "join", "node": "j", "t": 9.5, "ready_t": 11.0}
    row = join_metrics(res, ev, busy=[(9.0, 14.0)])
    assert row["scale_out_s"] == pytest.approx(1.6)
    assert row["replication_s"] == 0.8 and row["lower_bound_s"] == 0.7
    assert row["idle_s"] == pytest.approx(3 * 0.5)


def test_failure_detection_is_the_last_survivor_to_step_without_the_dead() -> None:
    res = RunResult(Scenario(), "test", 0.0)
    res.devices["a"] = _steps(0.0, [0.1] * 50) + _steps(5.0, [0.1] * 20, epoch=2, world=2)
    res.devices["b"] = _steps(0.0, [0.1] * 50) + _steps(5.5, [0.1] * 20, epoch=2, world=2)
    res.devices["x"] = _steps(0.0, [0.1] * 40)
    row = failure_metrics(res, {"kind": "kill", "node": "x", "t": 4.05})
    assert row["survivors"] == 2
    assert row["detection_s"] == pytest.approx(5.6 - 4.05)


def test_stall_is_the_largest_excess_step_and_consistency_counts_mismatches() -> None:
    res = RunResult(Scenario(), "test", 0.0)
    res.devices["a"] = _steps(0.0, [0.1] * 30 + [0.35] + [0.1] * 30)
    res.devices["b"] = _steps(0.0, [0.1] * 61)
    row = stall_metrics(res, {"kind": "link_add", "t": 3.0, "cli_s": 0.01}, busy=[(2.5, 7.0)])
    assert row["stall_s"] == pytest.approx(0.25) and row["control_s"] == 0.01
    assert consistency(res) == {"steps_compared": 61, "mismatches": 0, "redone": 0}
    res.devices["b"][10]["digest"] = "other"
    assert consistency(res)["mismatches"] == 1
    # b's last step before it was evicted (a partition cut it off as it completed a round the
    # others then redid without it) is redone work, not a mismatch; any other still is
    res.devices["b"][10]["digest"] = res.devices["a"][10]["digest"]
    res.devices["b"][40]["digest"] = "abandoned"
    evicted_t = res.devices["b"][40]["t"] + 0.05
    res.devices["b"].append({"kind": "trainer_event", "t": evicted_t, "event": "evicted"})
    assert consistency(res) == {"steps_compared": 61, "mismatches": 0, "redone": 1}
    res.devices["b"][39]["digest"] = "other"
    assert consistency(res)["mismatches"] == 1


# ------------------------------------------------------------------------------- end to end


def _left_namespaces(pid: int) -> list[str]:
    return [ns for ns in list_namespaces() if ns.startswith(f"chaos-{pid}-")]


def _run(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen([sys.executable, "-m", "chaos.emulate.cli", *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the harness tears its namespaces down on SIGTERM
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"chaos-emulate {argv[0]} ran past {timeout_s} s:\n{err[-3000:]}")
    finally:
        left = _left_namespaces(proc.pid)
        for ns in left:
            subprocess.run(["ip", "netns", "del", ns], check=False, timeout=10)
    assert not left, f"namespaces left behind: {left}"
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@needs_root
def test_demo_runs_end_to_end_and_cleans_up(tmp_path: Path) -> None:
    # the leftovers of an earlier run in the same folder (a leave flag, an old log) are cleared
    for i in range(5):
        stale = tmp_path / "run" / "devices" / f"n{i}"
        stale.mkdir(parents=True)
        (stale / "device.leave").touch()
        (stale / "device.jsonl").write_text('{"kind": "left", "t": 0.0, "step": 0}\n')
    res = _run(["demo", "--nodes", "4", "--scale", "0.05", "--out", str(tmp_path)], 600)
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads((tmp_path / "demo.json").read_text())
    kinds = {m["kind"] for m in doc["metrics"]}
    assert kinds == {"join", "leave", "kill", "link_add", "link_cut", "partition", "heal"}
    part = next(e for e in doc["harness_events"] if e["kind"] == "partition")
    assert part["nodes"] and part["links_cut"] >= 1
    assert doc["continuity"]["training_continued"] is True
    join = next(m for m in doc["metrics"] if m["kind"] == "join")
    assert join["scale_out_s"] > 0 and join["replication_s"] > 0 and join["lower_bound_s"] > 0
    kill = next(m for m in doc["metrics"] if m["kind"] == "kill")
    assert kill["detection_s"] is not None and kill["detection_s"] > 0
    assert doc["consistency"]["steps_compared"] > 0
    assert doc["consistency"]["mismatches"] == 0
    assert doc["network"] == "tc-shaped netns"
    # the cut link drops packets without closing a connection: the daemons find it down and
    # restart the allreduce, and the members blocked in it rerun the step at once, long before
    # the end of the run (step_timeout_s is 60 s there)
    cut = next(m for m in doc["metrics"] if m["kind"] == "link_cut")
    end = next(e["t"] for e in doc["harness_events"] if e["kind"] == "end")
    for node, recs in doc["devices"].items():
        if not any(r.get("kind") == "step" and r["t"] > cut["t"] - 1.0 for r in recs):
            continue  # gone before the cut
        resumed = [r for r in recs if r.get("kind") == "step" and r["t"] > cut["t"] + 0.5]
        assert resumed, f"{node} did not train after the link cut"
        # the routes go around a cut link, but an end of it with no other link is cut off like
        # the partition's minority; those rejoin after the heal, maybe just past the end
        cut_ev = next(e for e in doc["harness_events"] if e["kind"] == "link_cut")
        cut_off = {*part["nodes"], cut_ev["a"], cut_ev["b"]}
        if node not in cut_off:
            assert resumed[0]["t"] < end, f"{node} resumed only at the end"
        # stopped at the end with a graceful leave, not killed
        assert any(r.get("kind") == "left" for r in recs), f"{node} did not leave"
    assert cut["stall_s"] is not None
    assert (tmp_path / "demo.png").stat().st_size > 0
    assert "scale-out" in res.stdout or "join" in res.stdout


@needs_root
def test_compare_measures_each_strategy(tmp_path: Path) -> None:
    out = tmp_path / "cmp.json"
    res = _run(["compare", "--sizes", "3-4", "--model", "synthetic:32", "--scale", "0.05",
                "--strategies", "stop-resume,chaos", "--json", str(out),
                "--plot", str(tmp_path)], 600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert {r["strategy"] for r in runs} == {"stop-resume", "chaos"}
    for r in runs:
        assert (r["from_nodes"], r["to_nodes"]) == (3, 4)
        assert r["scale_out_s"] > 0 and r["state_bytes"] > 0
    sr = next(r for r in runs if r["strategy"] == "stop-resume")
    fetched = {n: t for n, t in sr["checkpoint_fetch_s"].items() if n != sr["checkpoint_store"]}
    assert set(fetched) == {"n0", "n1", "n2", "n3"} - {sr["checkpoint_store"]}
    assert all(t is not None and t > 0 for t in fetched.values())  # read over the links
    assert sr["checkpoint_fetch_s"][sr["checkpoint_store"]] is None  # the store reads its disk
    chaos = next(r for r in runs if r["strategy"] == "chaos")
    assert chaos["lower_bound_s"] > 0 and chaos["replication_s"] >= chaos["lower_bound_s"] * 0.5
    assert (tmp_path / "compare_scale_out.png").exists()


def test_refuses_bad_arguments() -> None:
    cli = [sys.executable, "-m", "chaos.emulate.cli"]
    bad = subprocess.run([*cli, "compare", "--sizes", "9-3", "--json", "/dev/null"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "N < M" in bad.stderr
    bad = subprocess.run([*cli, "run", "/nonexistent.toml", "--json", "/dev/null"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2
    bad = subprocess.run([*cli, "compare", "--first-repeat", "-1", "--json", "/dev/null"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "--first-repeat" in bad.stderr
