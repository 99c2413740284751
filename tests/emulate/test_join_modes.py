"""Join modes in the emulation harness: a scenario's and a join's ``join_mode``, and the figures
of a join that compare the modes (pure functions over a run's records; no cluster)."""

from __future__ import annotations

import pytest

from chaos.emulate.fleet import RunResult
from chaos.emulate.metrics import join_metrics
from chaos.emulate.scenario import Scenario, scenario_from_dict
from chaos.errors import ConfigError


def _steps(t0: float, durs: list[float], world: int = 3) -> list[dict]:
    out, t = [], t0
    for i, d in enumerate(durs):
        t += d
        out.append({"kind": "step", "t": t, "dur_s": d, "step": i, "epoch": 1, "world": world,
                    "digest": f"d{i}"})  # fmt: skip
    return out


def test_a_join_takes_its_own_mode_or_the_scenarios() -> None:
    sc = scenario_from_dict({"join_mode": "barrier", "events": [
        {"at_s": 1, "kind": "join"}, {"at_s": 2, "kind": "join", "join_mode": "catch-up"}]})
    assert sc.join_mode == "barrier"
    assert [e.join_mode for e in sc.events] == [None, "catch-up"]
    assert Scenario().join_mode == "catch-up"


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ({"join_mode": "lazy"}, "join_mode must be one of"),
        ({"events": [{"at_s": 1, "kind": "join", "join_mode": "lazy"}]}, "join_mode is for"),
        ({"events": [{"at_s": 1, "kind": "kill", "join_mode": "barrier"}]}, "join_mode is for"),
    ],
)
def test_bad_join_modes_are_refused(doc: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        scenario_from_dict(doc)


def test_non_donors_rate_and_the_catch_up_figures() -> None:
    res = RunResult(Scenario(), "test", 0.0)
    # the donor "c" slows down while it serves; "a" does not; "b" halves its rate
    res.devices["a"] = _steps(0.0, [0.1] * 150)
    res.devices["b"] = _steps(0.0, [0.1] * 95 + [0.2] * 10 + [0.1] * 50)
    res.devices["c"] = _steps(0.0, [0.1] * 95 + [0.3] * 5 + [0.1] * 50)
    res.daemon_events = [
        {"event": "scale_out_started", "peer": "j", "ts": 9.5},
        {"event": "scale_out_complete", "peer": "j", "ts": 11.5},
    ]
    res.devices["j"] = [
        {"kind": "ready", "t": 10.0, "events": [
            {"event": "replication_done", "elapsed_s": 0.4, "donors": {"c": 10}},
            {"event": "snapshot_pulled", "step": 97}]},
        {"kind": "trainer_event", "event": "replayed", "t": 11.2, "replayed": 14},
        {"kind": "trainer_event", "event": "entered", "t": 11.4, "step": 113, "replayed": 16,
         "pulled_bytes": 7},
    ]  # fmt: skip
    ev = {"kind": "join", "node": "j", "t": 9.6, "ready_t": 10.0, "join_mode": "catch-up"}
    row = join_metrics(res, ev, busy=[(9.0, 14.0)])
    assert row["join_mode"] == "catch-up" and row["donors"] == ["c"]
    assert set(row["non_donor_rate"]) == {"a", "b"}  # the donor is not counted
    assert row["non_donor_rate"]["a"] == pytest.approx(1.0)
    assert row["non_donor_rate_min"] == pytest.approx(0.5, abs=0.05)
    assert (row["snapshot_step"], row["entered_step"], row["replayed"]) == (97, 113, 16)
    assert row["entry_pulled_bytes"] == 7


def test_a_barrier_join_has_no_catch_up_figures() -> None:
    res = RunResult(Scenario(), "test", 0.0)
    res.devices["a"] = _steps(0.0, [0.1] * 150)
    res.devices["j"] = [{"kind": "ready", "t": 10.0, "events": []}]
    row = join_metrics(res, {"kind": "join", "node": "j", "t": 9.6, "ready_t": 10.0},
                       busy=[(9.0, 14.0)])  # fmt: skip
    assert row["replayed"] is None and row["entered_step"] is None


def test_a_grown_clusters_longer_steps_are_not_read_as_a_slowdown() -> None:
    """A cluster that grew from 2 to 3 members steps in 0.1 s instead of 0.05 s: against its
    steps at the size it had when the join began, a join that slowed nobody rates 1 and idles
    nothing (over the whole run's median, 0.05 s of the smaller cluster, it read about 0.5)."""
    res = RunResult(Scenario(), "test", 0.0)
    for name in ("a", "b"):
        small = _steps(0.0, [0.05] * 200, world=2)
        res.devices[name] = small + _steps(small[-1]["t"], [0.1] * 150, world=3)
    res.daemon_events = [
        {"event": "scale_out_started", "peer": "j", "ts": 18.0},
        {"event": "scale_out_complete", "peer": "j", "ts": 21.0},
    ]
    res.devices["j"] = [{"kind": "ready", "t": 21.0, "events": [
        {"event": "replication_done", "elapsed_s": 2.0, "donors": {"b": 10}}]}]  # fmt: skip
    ev = {"kind": "join", "node": "j", "t": 17.9, "ready_t": 21.0, "join_mode": "catch-up"}
    row = join_metrics(res, ev, busy=[(9.5, 13.0), (17.4, 24.0)])  # the growth, then this join
    assert row["non_donor_rate"] == {"a": pytest.approx(1.0)}
    assert row["idle_s"] == pytest.approx(0.0)
