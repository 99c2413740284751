"""The fault campaign (``chaos-emulate chaos``) and the partition/heal events of ``run``.

The pure parts (the seeded plan, the cut-vertex and bridge classification, the integrity, ETTR,
resume and resource computations) are tested on synthetic records. One short loopback campaign
runs real devices as processes (no root needed) and checks the JSON and that every process is
reaped; as root, a ``run`` with a partition and a heal runs in network namespaces. No timing is
asserted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from chaos.emulate.campaign import Campaign
from chaos.emulate.campaign_metrics import (
    annotate_members,
    bridges,
    cut_vertices,
    ettr,
    lineage,
    lineage_times,
    mark_single,
    per_kind,
    resource_summary,
    resume_times,
    single_faults,
    step_integrity,
)
from chaos.emulate.campaign_plan import CampaignConfig, draw_plan
from chaos.emulate.campaign_report import stored_lifetimes
from chaos.emulate.metrics import device_outages
from chaos.emulate.netns import list_namespaces
from chaos.emulate.scenario import scenario_from_dict
from chaos.emulate.schedule import random_overlay
from chaos.errors import ConfigError

# ------------------------------------------------------------------------------- the plan


def test_the_same_seed_draws_the_same_plan_and_another_seed_another() -> None:
    cfg = CampaignConfig(nodes=6, duration_s=600, rate_per_min=20, seed=3, min_live=3)
    a, b = draw_plan(cfg), draw_plan(cfg)
    assert a == b and len(a) > 100
    assert draw_plan(CampaignConfig(nodes=6, duration_s=600, rate_per_min=20, seed=4,
                                    min_live=3)) != a  # fmt: skip


def test_the_plan_keeps_the_cluster_within_its_bounds_and_heals_what_it_cuts() -> None:
    cfg = CampaignConfig(nodes=5, duration_s=3600, rate_per_min=30, seed=7, min_live=3,
                         max_live=8)  # fmt: skip
    plan = draw_plan(cfg)
    kinds = {e.kind for e in plan}
    assert kinds == {"join", "leave", "kill", "link_cut", "partition", "heal"}
    live, partitioned, names = 5, False, set()
    for e in plan:
        assert 0 <= e.at_s < cfg.duration_s
        if e.kind == "join":
            assert e.node not in names and e.node is not None
            names.add(e.node)
            live += 1
        elif e.kind in ("kill", "leave"):
            live -= 1
        elif e.kind == "partition":
            assert not partitioned, "a second partition before a heal"
            assert e.side in ("minority", "majority")
            partitioned = True
        elif e.kind == "heal":
            partitioned = False
        assert cfg.min_live <= live <= cfg.live_bound
    assert [e.at_s for e in plan] == sorted(e.at_s for e in plan)


def test_bad_campaign_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="nodes"):
        CampaignConfig(nodes=1)
    with pytest.raises(ConfigError, match="min_live"):
        CampaignConfig(nodes=4, min_live=5)
    with pytest.raises(ConfigError, match="weights"):
        CampaignConfig(weights={"explode": 1.0})
    for bad in (0, 9, True, 1.5):
        with pytest.raises(ConfigError, match="degree"):
            CampaignConfig(degree=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="step_timeout_s"):
        CampaignConfig(step_timeout_s=0.5)
    with pytest.raises(ConfigError, match="step_timeout_s"):
        scenario_from_dict({"nodes": 2, "step_timeout_s": 0})


def test_degree_one_builds_a_tree_overlay(tmp_path: Path) -> None:
    camp = Campaign(CampaignConfig(nodes=6, degree=1, seed=3), tmp_path, shaped=False)
    sc = camp.scenario()
    assert sc.degree == 1 and sc.step_timeout_s == 15.0  # the campaign's, not the scenario's
    edges = random_overlay(sc.nodes, sc.degree, sc.seed)
    assert len(edges) == sc.nodes - 1  # a tree: every inner device a cut vertex
    assert cut_vertices([f"n{i}" for i in range(sc.nodes)], edges)


# ------------------------------------------------------------------------------- the overlay


def test_a_device_hands_its_further_join_contacts_to_its_daemon() -> None:
    from chaos.emulate.device import split_join

    a, b, c = "tcp://10.255.0.1:7000", "tcp://10.255.0.2:7000", "tcp://10.255.0.3:7000"
    base = argparse.Namespace(join=f"{a},{b},{c}", daemon_arg=["--neighbor=n1"])
    got = split_join(base)
    assert got.join == a  # the Trainer takes one endpoint
    assert got.daemon_arg == ["--neighbor=n1", f"--join={b},{c}"]
    one = argparse.Namespace(join=a, daemon_arg=[])
    assert split_join(one) is one
    none = argparse.Namespace(join=None, daemon_arg=[])
    assert split_join(none).join is None


def test_cut_vertices_and_bridges_of_the_live_overlay() -> None:
    # a - b - c - d, plus the triangle c - d - e; f is dead (its links do not count)
    live = ["a", "b", "c", "d", "e"]
    edges = [("a", "b"), ("b", "c"), ("c", "d"), ("d", "e"), ("c", "e"), ("a", "f"), ("f", "e")]
    assert cut_vertices(live, edges) == {"b", "c"}
    assert bridges(live, edges) == {("a", "b"), ("b", "c")}
    # with f alive the ring a-b-c-e-f closes: no cut vertex, no bridge but none on the triangle
    assert cut_vertices([*live, "f"], edges) == set()
    assert bridges([*live, "f"], edges) == set()


def test_a_joiner_during_a_partition_links_only_to_the_largest_side() -> None:
    from chaos.emulate.campaign import outside_partitions

    live = ["a", "b", "c", "d", "e"]
    pool, healthy = ["a", "b", "c", "d"], ["a", "c"]
    assert outside_partitions(pool, healthy, [], live) == (pool, healthy)
    # {a, b} cut off from {c, d, e}: the joiner's links and contacts stay with c, d and e
    assert outside_partitions(pool, healthy, [("a", "b")], live) == (["c", "d"], ["c"])
    # a majority {a, b, c} cut off: the joiner comes up on its side
    assert outside_partitions(pool, healthy, [("a", "b", "c")], live) == (["a", "b", "c"],
                                                                           ["a", "c"])  # fmt: skip
    # nobody of the pool in the largest group: the pool is kept, no contact is
    assert outside_partitions(["a"], ["a"], [("a",)], live) == (["a"], [])


# ------------------------------------------------------------------------------- records


def _steps(t0: float, first: int, n: int, digest: str = "d", world: int = 3, epoch: int = 1,
           dt: float = 0.1) -> list[dict]:  # fmt: skip
    return [{"kind": "step", "t": t0 + i * dt, "step": first + i, "world": world,
             "epoch": epoch, "digest": f"{digest}{first + i}", "dur_s": dt}
            for i in range(n)]  # fmt: skip


def test_a_clean_history_has_nothing_lost_or_divergent() -> None:
    devs = {n: _steps(0.0, 1, 50) for n in ("a", "b", "c")}
    got = step_integrity(devs, ["a", "b", "c"])
    assert got["lost"] == 0 and got["divergent"] == 0 and got["redone"] == 0
    assert got["committed"] == 50 and got["steps"] == 50


def test_a_divergence_between_members_is_reported() -> None:
    devs = {n: _steps(0.0, 1, 20) for n in ("a", "b", "c")}
    devs["c"][9]["digest"] = "other"  # step 10: c disagrees with a and b in the same epoch
    got = step_integrity(devs, ["a", "b", "c"])
    assert got["divergent"] == 1 and got["divergent_steps"] == [10]


def test_a_committed_step_the_cluster_went_back_on_is_lost() -> None:
    # every member of a world-3 round committed steps 1..10 ('d'); then the survivors a, b
    # start over from step 8 under a new epoch with other digests ('r'): 8, 9, 10 are lost
    devs = {n: _steps(0.0, 1, 10, world=3) for n in ("a", "b", "x")}
    for n in ("a", "b"):
        devs[n] += _steps(5.0, 8, 10, digest="r", world=2, epoch=2)
    got = step_integrity(devs, ["a", "b"])
    assert got["lost"] == 3 and got["lost_steps"] == [8, 9, 10]
    assert got["divergent"] == 0


def test_a_round_one_member_finished_and_the_others_reran_is_redone_not_lost() -> None:
    devs = {n: _steps(0.0, 1, 10) for n in ("a", "b", "x")}
    devs["x"].append({"kind": "step", "t": 1.05, "step": 11, "world": 3, "epoch": 1,
                      "digest": "only-x"})  # fmt: skip
    for n in ("a", "b"):
        devs[n] += _steps(3.0, 11, 5, digest="r", world=2, epoch=2)
    got = step_integrity(devs, ["a", "b"])
    assert got == {**got, "lost": 0, "divergent": 0, "redone": 1}
    assert lineage(devs, ["a", "b"])[11] == "r11"


def test_a_survivor_cut_off_with_a_round_the_others_reran_is_not_divergent() -> None:
    """x finished round 11 as it was cut off; a and b reran it without x. x survives holding
    it, never trains on it (its last record), and would pull the current state on its rejoin:
    an abandoned tip, not a second state in use. Had x trained on it, it is divergent."""
    devs = {n: _steps(0.0, 1, 10) for n in ("a", "b", "x")}
    devs["x"].append({"kind": "step", "t": 1.05, "step": 11, "world": 3, "epoch": 1,
                      "digest": "only-x"})  # fmt: skip
    for n in ("a", "b"):
        devs[n] += _steps(3.0, 11, 5, digest="r", world=2, epoch=2)
    got = step_integrity(devs, ["a", "b", "x"])
    assert got == {**got, "lost": 0, "divergent": 0, "redone": 1, "abandoned_tips": [["x", 11]]}
    devs["x"].append({"kind": "step", "t": 1.2, "step": 12, "world": 1, "epoch": 1,
                      "digest": "x-on-its-own"})  # fmt: skip
    got = step_integrity(devs, ["a", "b", "x"])
    assert got["divergent"] == 1 and got["divergent_steps"] == [11]  # it built on it


def test_a_tip_a_survivor_replaced_by_joining_again_is_abandoned_not_divergent() -> None:
    """x finished round 11 as it was cut off; a and b reran it without x. x then joined
    again, pulling the cluster's state (at step 13), and trained on that: its round 11 was
    never built on. Without the pull between, its next step would be built on it."""
    devs = {n: _steps(0.0, 1, 10) for n in ("a", "b", "x")}
    devs["x"].append({"kind": "step", "t": 1.05, "step": 11, "world": 3, "epoch": 1,
                      "digest": "only-x"})  # fmt: skip
    for n in ("a", "b"):
        devs[n] += _steps(3.0, 11, 5, digest="r", world=2, epoch=2)
    devs["x"] += [{"kind": "trainer_event", "t": 3.25, "event": "snapshot_pulled", "step": 13},
                  *_steps(3.3, 14, 2, digest="r", world=3, epoch=3)]  # fmt: skip
    got = step_integrity(devs, ["a", "b", "x"])
    assert got == {**got, "lost": 0, "divergent": 0, "abandoned_tips": [["x", 11]]}
    devs["x"] = [r for r in devs["x"] if r["kind"] == "step"]  # no pull: built on it
    assert step_integrity(devs, ["a", "b", "x"])["divergent_steps"] == [11]


def test_ettr_counts_useful_steps_at_the_normal_step_time() -> None:
    # 100 steps at 0.1 s, a 10 s stall, 100 more: 200 useful steps of 0.1 s in 30 s of wall
    devs = {"a": _steps(0.0, 1, 100) + _steps(19.9, 101, 100)}
    hist = lineage(devs, ["a"])
    got = ettr(lineage_times(devs, hist), 0.0, 30.0)
    assert got["useful_steps"] == 200
    assert got["tau_s"] == pytest.approx(0.1)
    assert got["ettr"] == pytest.approx(200 * 0.1 / 30.0)
    assert got["lost_s"] == pytest.approx(10.0)
    # redone work adds no useful step: a step done twice counts once
    devs["b"] = [{**r, "digest": "old"} for r in devs["a"][150:160]]
    got2 = ettr(lineage_times(devs, lineage(devs, ["a"])), 0.0, 30.0)
    assert got2["useful_steps"] == 200


def test_resume_waits_for_every_running_device_that_is_not_paused() -> None:
    devs = {"a": _steps(0.0, 1, 10) + _steps(3.0, 11, 5),
            "b": _steps(0.0, 1, 10) + _steps(4.0, 11, 5),
            "c": _steps(0.0, 1, 10),   # paused after the fault
            "d": _steps(0.0, 1, 10)}  # fmt: skip
    daemon = [{"node": "c", "event": "paused", "ts": 2.0}]
    life = {
        "a": (0.0, float("inf")),
        "b": (0.0, float("inf")),
        "c": (0.0, float("inf")),
        "d": (0.0, 1.5),
    }  # d is the victim's neighbour, killed later at 1.5 s
    inj = [{"t": 1.2, "kind": "partition", "label": "partition c"},
           {"t": 5.0, "kind": "kill", "node": "b", "label": "kill b"}]  # fmt: skip
    rows = resume_times(inj, devs, daemon, life)
    assert rows[0]["resumed"] and rows[0]["resume_s"] == pytest.approx(4.0 - 1.2)
    assert rows[0]["paused"] == ["c"] and rows[0]["waited"] == ["a", "b"]
    # at 5.0 a steps until 3.4 and never again, b is the victim, c is still paused: not resumed
    assert not rows[1]["resumed"] and rows[1]["not_resumed"] == ["a"]
    table = per_kind(rows, inj)
    assert table["partition"]["resumed"] == 1 and table["kill"]["not_resumed"] == 1


def test_a_fault_does_not_wait_for_a_device_that_was_joining_again_at_it() -> None:
    """c was evicted (not in the view current at the kill) and steps again only once its
    rejoin is done: the kill of d resumed when a and b stepped; c's rejoin is a join. A heal
    at the same moment waits for c: bringing it back is what a heal does."""
    devs = {"a": _steps(0.0, 1, 10) + _steps(1.5, 11, 5),
            "b": _steps(0.0, 1, 10) + _steps(1.6, 11, 5),
            "c": _steps(0.0, 1, 4) + _steps(6.0, 11, 5),
            "d": _steps(0.0, 1, 10)}  # fmt: skip
    daemon = [{"node": "a", "event": "view_installed", "ts": 0.1, "epoch": 1,
               "members": ["a", "b", "c", "d"]},
              {"node": "a", "event": "view_installed", "ts": 0.5, "epoch": 2,
               "members": ["a", "b", "d"]},  # c evicted
              {"node": "a", "event": "view_installed", "ts": 2.5, "epoch": 4,
               "members": ["a", "b", "c"]}]  # d gone, c back  # fmt: skip
    life = {n: (0.0, float("inf")) for n in "abc"} | {"d": (0.0, 1.0)}
    kill = [{"t": 1.0, "kind": "kill", "node": "d", "label": "kill d"}]
    row = resume_times(kill, devs, daemon, life)[0]
    assert row["resumed"] and row["resume_s"] == pytest.approx(1.6 - 1.0)  # b's first step after it
    assert row["joining"] == ["c"] and row["waited"] == ["a", "b"]
    heal = [{"t": 1.0, "kind": "heal", "label": "heal"}]
    row = resume_times(heal, devs, daemon, life)[0]
    assert row["joining"] == [] and "c" in row["waited"]
    assert row["resume_s"] == pytest.approx(6.0 - 1.0)


def test_a_stored_report_gives_back_its_lifetimes_or_has_them_rebuilt() -> None:
    doc = {"lifetimes": {"a": [1.0, None], "b": [None, 7.0]}}
    assert stored_lifetimes(doc) == {"a": (1.0, math.inf), "b": (math.inf, 7.0)}
    old = {"devices": {"a": [{"kind": "ready", "t": 1.0}, {"kind": "step", "t": 2.0}],
                       "b": [{"kind": "ready", "t": 3.0}], "j": []},
           "harness_events": [{"kind": "join", "t": 0.5, "node": "j"},
                              {"kind": "kill", "t": 5.0, "node": "b"},
                              {"kind": "join_failed", "t": 6.0, "node": "j"}]}  # fmt: skip
    assert stored_lifetimes(old) == {"a": (1.0, math.inf), "b": (3.0, 5.0),
                                     "j": (math.inf, 6.0)}  # fmt: skip


def _row(t: float, kind: str, resume_s: float | None) -> dict[str, object]:
    return {"t": t, "kind": kind, "label": kind, "resumed": resume_s is not None,
            "resume_s": resume_s}  # fmt: skip


def test_a_fault_is_single_only_on_a_calm_cluster_and_alone_until_it_resumed() -> None:
    rows = [_row(0.0, "kill", 1.0),        # alone: the next comes at 5
            _row(5.0, "link_cut", 3.0),    # overlapped: the next comes at 6, before 8
            _row(6.0, "partition", 1.0),   # came while the cut was being recovered from
            _row(20.0, "join", 0.5),       # no fault kind, but it disturbs (the kill overlaps it)
            _row(20.2, "kill", 1.0),       # came before the join resumed
            _row(40.0, "leave", None),     # never resumed, on a calm cluster: single, failed
            _row(60.0, "kill", 2.0)]  # previous never resumed: not calm  # fmt: skip
    mark_single(rows)
    assert [r["single"] for r in rows] == [True, False, False, False, False, True, False]
    one = single_faults(rows)
    assert one["injected"] == 2 and one["resumed"] == 1 and one["not_resumed"] == 1
    assert one["resume_p50_s"] == 1.0 and one["overlapping"] == 4  # the join is no fault
    table = per_kind(rows, [])
    assert table["kill"]["single"] == 1 and table["kill"]["injected"] == 3
    assert table["kill"]["single_p99_s"] == 1.0 and table["leave"]["single_resumed"] == 0


def test_outages_name_the_paused_stalled_and_stopped_devices() -> None:
    devs = {"a": _steps(0.0, 1, 30) + _steps(10.0, 31, 30),
            "b": _steps(0.0, 1, 30) + _steps(12.0, 31, 30),
            "c": _steps(0.0, 1, 30),
            "k": _steps(0.0, 1, 10)}  # fmt: skip
    daemon = [{"node": "b", "event": "paused", "ts": 5.0}]
    got = device_outages(devs, daemon, end_t=13.5, gone={"k": "kill"})
    assert [g["kind"] for g in got["a"]] == ["stalled"]
    assert got["a"][0]["s"] == pytest.approx(10.0 - 2.9)
    assert [g["kind"] for g in got["b"]] == ["paused"]
    assert [g["kind"] for g in got["c"]] == ["stopped"]
    assert "k" not in got


def test_resources_report_first_last_and_max_ratio_after_warm_up() -> None:
    samples = [{"t": t, "node": "a", "proc": "trainer", "rss": rss, "fds": 20}
               for t, rss in ((1.0, 50), (12.0, 100), (17.0, 120), (22.0, 105))]  # fmt: skip
    got = resource_summary(samples, {"a": 0.0}, warmup_s=10.0)
    a = got["per_process"]["a/trainer"]
    assert (a["rss_first"], a["rss_last"], a["samples"]) == (100, 105, 3)
    assert a["rss_max_ratio"] == pytest.approx(1.2) and a["fds_max_ratio"] == 1.0
    assert got["flat_within_10pct"] is False
    assert a["rss_same_size_ratio"] is None and got["flat_at_same_size"] is True  # no sizes


def test_samples_take_the_size_of_the_view_their_daemon_had_installed() -> None:
    samples = [{"t": t, "node": "a", "proc": "daemon", "rss": 1, "fds": 1} for t in (1, 5, 9)]
    samples.append({"t": 5, "node": "b", "proc": "daemon", "rss": 1, "fds": 1})
    events = [{"node": "a", "event": "view_installed", "ts": 2.0, "members": ["a", "b"]},
              {"node": "a", "event": "view_installed", "ts": 8.0, "members": ["a", "b", "c"]},
              {"node": "a", "event": "paused", "ts": 8.5}]  # fmt: skip
    annotate_members(samples, events)
    assert [s.get("members") for s in samples] == [None, 2, 3, None]


def test_open_files_that_follow_the_cluster_size_are_flat_at_equal_size_and_a_leak_is_not() -> None:
    sizes = (6, 8, 6, 8, 6)
    follows = [{"t": 10.0 * i, "node": "a", "proc": "daemon", "rss": 100, "fds": 5 * n,
                "live": n} for i, n in enumerate(sizes)]  # fmt: skip
    got = resource_summary(follows, {"a": 0.0}, warmup_s=0.0)
    assert got["worst_fds_ratio"] == pytest.approx(40 / 30)  # the plain ratio moves
    assert got["worst_fds_same_size_ratio"] == 1.0 and got["flat_at_same_size"] is True
    leaks = [{**x, "fds": x["fds"] + 4 * i} for i, x in enumerate(follows)]
    got = resource_summary(leaks, {"a": 0.0}, warmup_s=0.0)
    assert got["worst_fds_same_size_ratio"] == pytest.approx(46 / 30)
    assert got["flat_at_same_size"] is False


# ------------------------------------------------------------------------------- scenarios


def test_partition_and_heal_events_load_and_are_checked() -> None:
    sc = scenario_from_dict({"nodes": 4, "events": [
        {"at_s": 5, "kind": "partition", "nodes": ["n0", "n1"]},
        {"at_s": 9, "kind": "heal"},
        {"at_s": 12, "kind": "partition"}]})  # fmt: skip
    assert [e.label() for e in sc.events] == ["partition n0,n1", "heal", "partition"]
    for bad, match in (({"at_s": 1, "kind": "partition", "nodes": ["n7"]}, "not running"),
                       ({"at_s": 1, "kind": "partition", "nodes": "n1"}, "list"),
                       ({"at_s": 1, "kind": "kill", "nodes": ["n1"]}, "only a partition"),
                       ({"at_s": 1, "kind": "partition", "nodes": ["n0", "n1", "n2", "n3"]},
                        "outside")):  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            scenario_from_dict({"nodes": 4, "events": [bad]})


# ------------------------------------------------------------------------------- real processes

CLI = [sys.executable, "-m", "chaos.emulate.cli"]


def _descendants_alive(pid: int) -> list[int]:
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if f"-{pid}-" in cmd or (str(pid) in cmd and "chaos" in cmd and p.info["pid"] != pid):
            out.append(p.info["pid"])
    return out


def _campaign(args: list[str], out: Path) -> tuple[subprocess.Popen[str], str, dict[str, Any]]:
    """Runs ``chaos-emulate chaos ARGS --json OUT`` to its end (killed past 420 s); returns the
    process, its stdout and the report."""
    proc = subprocess.Popen([*CLI, "chaos", *args, "--json", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        stdout, stderr = proc.communicate(timeout=30)
        pytest.fail(f"the campaign ran past 420 s:\n{stderr[-3000:]}")
    assert proc.returncode == 0, stderr[-3000:]
    return proc, stdout, json.loads(out.read_text())


def test_a_short_loopback_campaign_reports_every_field_and_reaps_its_processes(
    tmp_path: Path,
) -> None:
    out = tmp_path / "c.json"
    proc, stdout, doc = _campaign(["--nodes", "3", "--duration", "45", "--rate", "8", "--seed",
                                   "2", "--loopback", "--sample", "2", "--warmup", "5",
                                   "--plot", str(tmp_path)], out)  # fmt: skip
    for key in ("config", "network", "injected_faults", "per_kind", "all_resumed",
                "committed_steps_lost", "divergent_states", "integrity", "crashed_processes",
                "crashes", "ettr", "resources", "survivors", "outages", "injections",
                "harness_events", "timeline", "samples", "devices"):  # fmt: skip
        assert key in doc, key
    assert doc["network"] == "loopback (unshaped)"
    assert set(doc["per_kind"]) == {"join", "leave", "kill", "link_cut", "partition", "heal"}
    for entry in doc["per_kind"].values():
        assert {"injected", "resumed", "not_resumed", "resume_p50_s", "resume_p99_s"} <= set(entry)
    assert doc["injected_faults"] >= 1
    for row in doc["injections"]:
        assert isinstance(row["resumed"], bool)
    for join in (e for e in doc["harness_events"] if e["kind"] == "join" and "contacts" in e):
        assert set(join["neighbors"]) <= set(join["contacts"])  # the healthy ones, then these
    assert {"ettr", "useful_steps", "tau_s", "wall_s", "lost_s"} <= set(doc["ettr"])
    assert doc["ettr"]["useful_steps"] > 0
    assert doc["samples"], "no RSS / fd sample"
    # a trainer's sample carries the data-plane links of its last step (3 devices: 1 or 2
    # each, 0 while alone), so open files are compared at equal load too
    loads = [s["links"] for s in doc["samples"] if s["proc"] == "trainer" and "links" in s]
    assert loads and all(0 <= k <= 2 for k in loads) and max(loads) >= 1
    assert "worst_fds_same_load_ratio" in doc["resources"]
    assert "committed steps lost" in stdout and "ETTR" in stdout
    # the report again from the JSON: the same resources, recomputed from the samples
    again = subprocess.run([*CLI, "chaos-report", str(out), "--json", str(tmp_path / "r.json")],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    again_doc = json.loads((tmp_path / "r.json").read_text())
    # the same fault figures, from the lifetimes the report stored
    assert again_doc["single_faults"] == doc["single_faults"]
    assert again_doc["injections"] == doc["injections"]
    redone = again_doc["resources"]
    assert redone["per_process"]
    assert set(redone["per_process"]) <= set(doc["resources"]["per_process"])
    for key, entry in redone["per_process"].items():  # the same figures, and the new one
        assert entry["fds_same_load_ratio"] == doc["resources"]["per_process"][key][
            "fds_same_load_ratio"]
        assert "fds_settled_ratio" in entry
    assert "committed steps lost" in again.stdout and "settled" in again.stdout
    assert (tmp_path / "chaos_timeline.png").stat().st_size > 0
    # every device process (trainers and their daemons) is gone
    pids = [d for d in _descendants_alive(proc.pid)]
    assert not pids, f"processes left behind: {pids}"
    run_dir = str(tmp_path / "c-run")
    left = [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
            if run_dir in " ".join(p.info["cmdline"] or [])]  # fmt: skip
    assert not left, f"device processes left behind: {left}"


def test_a_loopback_campaign_in_local_steps_mode_loses_nothing_and_stays_equal(
    tmp_path: Path,
) -> None:
    """The same campaign with every device in local-steps mode (an outer step every 8 inner
    steps, the outer step beside the next inner phase): a link cut, a partition, a leave, a
    join, a kill and heals (seed 10's plan); every committed outer step kept, no divergent
    global state, no crash, every fault resumed, and the trainers' own audits all agree."""
    _, _, doc = _campaign(["--nodes", "4", "--duration", "40", "--rate", "9", "--seed", "10",
                           "--min-live", "2", "--loopback", "--inner-steps", "8", "--overlap"],
                          tmp_path / "c.json")  # fmt: skip
    assert (doc["config"]["inner_steps"], doc["config"]["overlap"]) == (8, True)
    kinds = {r["kind"] for r in doc["injections"]}
    assert {"link_cut", "partition", "join"} <= kinds, kinds
    assert all(r["resumed"] for r in doc["injections"]), doc["injections"]
    integ = doc["integrity"]
    assert integ["committed"] >= 20 and integ["lost"] == 0 and integ["divergent"] == 0, integ
    assert doc["crashed_processes"] == 0 and not doc["crashes"]
    assert doc["audit"]["audits"] >= 20 and doc["audit"]["mismatches"] == 0, doc["audit"]
    # the steps are outer steps: each record carries its phase's inner steps
    inner = [r["inner_steps"] for recs in doc["devices"].values() for r in recs
             if r.get("kind") == "step"]  # fmt: skip
    assert inner and max(inner) == 8


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="partitions cut tc-shaped veth links in network namespaces: needs root and iproute2",
)


@needs_root
def test_run_partitions_a_cut_vertex_side_and_heals_in_namespaces(tmp_path: Path) -> None:
    scenario = tmp_path / "p.toml"
    scenario.write_text(
        'name = "partition"\nnodes = 4\nmodel = "synthetic:8"\nscale = 0.05\nsettle_s = 12\n'
        '[[events]]\nat_s = 4\nkind = "partition"\nnodes = ["n3"]\n'
        '[[events]]\nat_s = 14\nkind = "heal"\n'
        '[[events]]\nat_s = 16\nkind = "kill"\n'
    )
    out = tmp_path / "p.json"
    proc = subprocess.Popen([*CLI, "run", str(scenario), "--json", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=500)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the harness tears its namespaces down on SIGTERM
        stdout, stderr = proc.communicate(timeout=60)
        pytest.fail(f"the run took more than 500 s:\n{stderr[-3000:]}")
    finally:
        left = [ns for ns in list_namespaces() if ns.startswith(f"chaos-{proc.pid}-")]
        for ns in left:
            subprocess.run(["ip", "netns", "del", ns], check=False, timeout=10)
    assert not left, f"namespaces left behind: {left}"
    assert proc.returncode == 0, stderr[-3000:]
    doc = json.loads(out.read_text())
    part = next(e for e in doc["harness_events"] if e["kind"] == "partition")
    assert part["nodes"] == ["n3"] and part["links_cut"] >= 1
    # what the cut left: n3 alone, and every running device in one group or another
    assert ["n3"] in part["groups"]
    assert sorted(n for g in part["groups"] for n in g) == ["n0", "n1", "n2", "n3"]
    biggest = max(len(g) for g in part["groups"])
    assert part["connected_majority"] is (biggest == 3)
    heal = next(e for e in doc["harness_events"] if e["kind"] == "heal")
    assert heal["partitions"] == [["n3"]]
    assert doc["continuity"]["training_continued"] is True
    assert doc["consistency"]["mismatches"] == 0
    assert "training continued" in stdout


def test_a_device_the_cluster_evicted_is_not_waited_for() -> None:
    devs = {
        "a": _steps(0.0, 1, 10) + _steps(3.0, 11, 5),
        "b": _steps(0.0, 1, 10) + _steps(3.2, 11, 5),
        "c": _steps(0.0, 1, 10),
    }  # cut off: evicted, runs elections, never steps again
    daemon = [{"node": "a", "event": "view_installed", "ts": 2.5, "epoch": 7,
               "members": ["a", "b"]},
              {"node": "c", "event": "view_installed", "ts": 0.5, "epoch": 5,
               "members": ["a", "b", "c"]}]  # fmt: skip
    life = {n: (0.0, float("inf")) for n in devs}
    rows = resume_times([{"t": 1.5, "kind": "link_cut", "label": "link_cut a-c"}], devs, daemon,
                        life)  # fmt: skip
    assert rows[0]["resumed"] and rows[0]["paused"] == ["c"]
    assert rows[0]["resume_s"] == pytest.approx(3.2 - 1.5)  # b, the last member to step


def test_trainer_samples_take_the_links_and_role_of_their_last_step() -> None:
    from chaos.emulate.campaign_metrics import annotate_load

    devices = {"a": [{"kind": "step", "t": 2.0, "links": 1, "serving": False},
                     {"kind": "trainer_event", "t": 3.0},
                     {"kind": "step", "t": 6.0, "links": 3, "serving": True}]}  # fmt: skip
    samples = [{"t": t, "node": "a", "proc": "trainer", "rss": 1, "fds": 1} for t in (1, 4, 7)]
    samples.append({"t": 7, "node": "a", "proc": "daemon", "rss": 1, "fds": 1})
    annotate_load(samples, devices)
    assert [(s.get("links"), s.get("serving")) for s in samples] == [
        (None, None), (1, False), (3, True), (None, None)]


def test_open_files_that_follow_the_data_plane_links_are_flat_at_equal_load() -> None:
    links = (1, 3, 1, 3, 1)  # a tree hub and a leaf in turn, in one cluster size
    follows = [{"t": 10.0 * i, "node": "a", "proc": "trainer", "rss": 100, "fds": 60 + 5 * k,
                "members": 6, "links": k, "serving": False}
               for i, k in enumerate(links)]  # fmt: skip
    got = resource_summary(follows, {"a": 0.0}, warmup_s=0.0)
    assert got["worst_fds_same_size_ratio"] == pytest.approx(75 / 65)  # moves with the links
    assert got["worst_fds_same_load_ratio"] == 1.0 and got["flat_at_same_load"] is True
    leaks = [{**x, "fds": x["fds"] + 4 * i} for i, x in enumerate(follows)]
    got = resource_summary(leaks, {"a": 0.0}, warmup_s=0.0)
    assert got["worst_fds_same_load_ratio"] == pytest.approx(81 / 65)
    assert got["flat_at_same_load"] is False


def _daemon_series(fds: list[int]) -> list[dict[str, Any]]:
    return [{"t": 5.0 * i, "node": "a", "proc": "daemon", "rss": 100, "fds": f, "members": 8}
            for i, f in enumerate(fds)]  # fmt: skip


def test_a_level_that_comes_back_is_settled_and_one_that_stays_up_is_not() -> None:
    """A first sample in a dip (connections down during a partition) and a bump of a few
    samples (a socket per contact while joining again) read as growth max over first, not
    settled; a step that stays (a thread with its own context started mid-run) reads as
    both."""
    transient = _daemon_series([49, 56, 56, 63, 63, 56, 56, 56, 56, 56, 56, 56])
    got = resource_summary(transient, {"a": 0.0}, warmup_s=0.0)
    assert got["worst_fds_same_load_ratio"] == pytest.approx(63 / 49)
    assert got["worst_fds_settled_ratio"] == 1.0 and got["settled_within_10pct"] is True
    stays = _daemon_series([49, 49, 49, 49, 49, 56, 56, 56, 56, 56])
    got = resource_summary(stays, {"a": 0.0}, warmup_s=0.0)
    assert got["worst_fds_settled_ratio"] == pytest.approx(56 / 49)
    assert got["settled_within_10pct"] is False


def test_too_few_samples_at_one_load_are_not_judged_settled() -> None:
    got = resource_summary(_daemon_series([40, 60, 60]), {"a": 0.0}, warmup_s=0.0)
    assert got["worst_fds_settled_ratio"] is None and got["settled_within_10pct"] is True


def test_chaos_report_refuses_a_file_that_is_not_a_runs_json(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from chaos.emulate.cli import main

    bad = tmp_path / "bad.json"
    for text in ("{}", "not json", json.dumps({"devices": {}, "samples": 3})):
        bad.write_text(text)
        res = CliRunner().invoke(main, ["chaos-report", str(bad)])
        assert res.exit_code != 0 and "not a chaos run's JSON" in res.output, res.output
