"""The replication planner's measured inputs: tau_sync from the trainers' step progress, the
per-shard cost c from completed pulls (``chaos.daemon.scheduler.monitor``).

The fit and the clock are pure and tested with numbers; the last test runs real daemons whose
trainers are a :class:`DaemonClient` and a :class:`StepBeacon` on their IPC sockets, and checks
that both measurements reach the scheduler's plans and ``chaos-daemon status``.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from chaos.daemon.client import DaemonClient
from chaos.daemon.scheduler.monitor import (
    MAX_PER_SHARD_COST_S,
    ClusterMonitor,
    PullSample,
    RoundClock,
    fit_per_shard_cost,
)
from daemon_helpers import Cluster, Node, free_port, wait_until

from chaos.protocol import PolicyReply, PullDone, TrainerReady
from chaos.protocol.messages import DonorPull, PullReport
from chaos.trainer.session import StepBeacon

SIZES = [200_000, 50_000, 10_771]


def test_the_fit_recovers_c_from_each_donors_unexplained_time() -> None:
    c = 3e-4
    samples = [PullSample(n, m + n * c, m) for n, m in ((10, 0.2), (40, 0.05), (7, 1.0))]
    assert fit_per_shard_cost(samples) == pytest.approx(c)
    # a bandwidth measured too low leaves nothing to explain: c is 0, never negative
    assert fit_per_shard_cost([PullSample(10, 0.1, 0.5)]) == 0.0
    assert fit_per_shard_cost([PullSample(1, 100.0, 0.0)]) == MAX_PER_SHARD_COST_S
    assert fit_per_shard_cost([PullSample(0, 1.0, 0.0)]) is None


def test_the_monitor_smooths_c_over_pulls() -> None:
    m = ClusterMonitor()
    assert m.per_shard_cost_s is None and m.observe_pull([]) is None
    assert m.observe_pull([PullSample(10, 0.01, 0.0)]) == pytest.approx(1e-3)
    assert m.per_shard_cost_s == pytest.approx(1e-3)  # the first fit replaces the prior
    m.observe_pull([PullSample(10, 0.02, 0.0)])
    assert 1e-3 < (m.per_shard_cost_s or 0.0) < 2e-3 and m.pulls_measured == 2


def test_tau_sync_is_the_time_left_in_the_donors_step() -> None:
    m = ClusterMonitor()
    # a trainer stepping every 0.1 s, seen computing 0.03 s into steps 5, 9 and 12
    for step in (5, 9, 12):
        m.observe_progress("d", step, False, 0.03, 10.0 + 0.1 * step + 0.03)
    clock = m.clocks["d"]
    assert clock.period_s == pytest.approx(0.1) and clock.step == 12
    # 0.25 s after step 12 began: 2.5 periods in, so half a period is left
    assert m.tau_sync_s("d", 11.2 + 0.25, max_age_s=1.0) == pytest.approx(0.05)
    # reports inside update() say nothing of the boundary, but keep the clock fresh
    m.observe_progress("d", 12, True, 0.01, 12.0)
    assert m.tau_sync_s("d", 12.5, max_age_s=1.0) is not None
    assert m.tau_sync_s("d", 14.0, max_age_s=1.0) is None  # stale
    assert m.tau_sync_s("other", 12.0, max_age_s=1.0) is None
    assert RoundClock(0, 0.0).left_s(1.0) is None  # no period yet


def _client(node: Node) -> DaemonClient:
    return DaemonClient(node.ipc, timeout_s=10.0)


def _policy(node: Node) -> PolicyReply:
    with _client(node) as c:
        return c.policy(timeout_s=2.0)


def _register(node: Node, has_state: bool) -> int:
    ep = f"tcp://127.0.0.1:{free_port()}"
    with _client(node) as c:
        res = c.register_trainer(ep, ep, has_state, SIZES if has_state else None, timeout_s=10.0)
    assert res.ok
    return int(res.epoch)


def _status(cluster: Cluster, node: Node) -> dict[str, Any]:
    res = cluster.cli(node, "status", "--json")
    assert res.returncode == 0, res.stderr
    status: dict[str, Any] = json.loads(res.stdout)
    return status


def test_tau_sync_and_c_are_measured_and_reach_the_plans_and_status(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.start(3)
    _register(n1, True)
    beacon = StepBeacon(n1.ipc)  # n1's trainer: a step every 0.25 s, in update() half of it
    try:
        status = _status(cluster, n1)
        assert any("configured prior" in n for n in status["notes"])
        step = 0
        deadline = time.monotonic() + 6.0
        while time.monotonic() < deadline:  # a few seconds of steps, which the relay forwards
            step += 1
            beacon.note(step, in_step=False)
            time.sleep(0.125)
            beacon.note(step, in_step=True)
            time.sleep(0.125)
        beacon.note(step + 1, in_step=False)  # the step goes on while n2 registers
        epoch = _register(n2, False)
    finally:
        beacon.close()
    rep = wait_until(lambda: (p := _policy(n2)).epoch >= epoch and p.replication, "n2's plan")
    (donor,) = rep.donors
    assert donor.id == "n1" and 0.0 < donor.sync_s <= 0.25 + 0.1  # the time left in its step
    links = {(x["a"], x["b"]): x for x in _status(cluster, n1)["links"]}
    assert links[("n1", "n2")]["tau_sync_s"] == pytest.approx(donor.sync_s)
    planned = [
        e for e in n1.events() if e["event"] == "replication_planned" and e.get("assignment")
    ]
    assert planned[-1]["sync_s"] == {"n1": pytest.approx(donor.sync_s)}

    # n2 pulled: 3 shards of its plan's bytes in what the plan's model gives plus 2 ms each
    shards, c = 3, 2e-3
    nbytes = sum(n for _, n in rep.assignment["n1"])
    elapsed = donor.prop_s + nbytes * donor.trans_s_per_byte + shards * c
    pull = PullReport(state_bytes=sum(SIZES), per_shard_cost_s=rep.per_shard_cost_s, donors=[
        DonorPull(id="n1", bytes=nbytes, shards=shards, elapsed_s=elapsed,
                  ranges=[(0, sum(SIZES))])])  # fmt: skip
    with _client(n2) as cl:
        assert cl.op(PullDone(pull=pull), timeout_s=10.0).ok
    done = [e for e in n1.events() if e["event"] == "replication_executed"]
    assert done[-1]["peer"] == "n2" and done[-1]["per_shard_cost_fit_s"] == pytest.approx(c)
    assert done[-1]["as_planned"] is (rep.assignment == {"n1": [(0, sum(SIZES))]})
    notes = _status(cluster, n1)["notes"]
    assert any("c = 0.002 s, measured over 1 pulls" in n for n in notes), notes
    # the next joiner's plan uses (and carries, for its re-plans) the measured c
    with _client(n2) as cl:
        assert cl.trainer_event(TrainerReady(elapsed_s=0.1), timeout_s=10.0).ok
    epoch = _register(n3, False)
    rep3 = wait_until(lambda: (p := _policy(n3)).epoch >= epoch and p.replication, "n3's plan")
    assert rep3.target == "n3" and rep3.per_shard_cost_s == pytest.approx(c)
    assert rep.per_shard_cost_s == pytest.approx(4e-6)  # n2's: the prior, before any pull
