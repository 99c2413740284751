"""The daemon side of the trainer interface (docs/trainer-daemon-interface.md), on real daemons.

The trainer here is only a :class:`DaemonClient` on the daemon's IPC socket: the data plane is
not under test, so the data and shard endpoints it registers are addresses nobody serves.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from chaos.daemon.client import DaemonClient, RequestRefused
from daemon_helpers import Cluster, Node, free_port, wait_until

from chaos.protocol import (
    MAX_STATE_TENSORS,
    CaughtUp,
    PolicyReply,
    PullDone,
    StepFailed,
    TrainerReady,
    TrainerRegister,
)
from tests.daemon.recorder import Recorder, recording_context

SIZES = [4096, 1000, 123_457, 8]


def _ep(tag: str) -> str:
    return f"tcp://127.0.0.1:{free_port()}" if tag == "tcp" else f"ipc:///tmp/chaos-test-{tag}"


def _trainer(node: Node) -> DaemonClient:
    """The fake trainer: a client of the node's local (IPC) endpoint."""
    return DaemonClient(node.ipc, timeout_s=10.0)


def _policy(node: Node) -> PolicyReply:
    with _trainer(node) as c:
        return c.policy(timeout_s=2.0)


def _register(
    node: Node, has_state: bool, sizes: list[int] | None = None, data: str = "", shard: str = ""
) -> tuple[int, str, str]:
    data = data or _ep("tcp")
    shard = shard or _ep("tcp")
    with _trainer(node) as c:
        res = c.register_trainer(data, shard, has_state, sizes, timeout_s=10.0)
    assert res.ok
    return res.epoch, data, shard


def _refusal(node: Node, has_state: bool, sizes: list[int] | None = None) -> str:
    with _trainer(node) as c, pytest.raises(RequestRefused) as info:
        c.register_trainer(_ep("tcp"), _ep("tcp"), has_state, sizes, timeout_s=10.0)
    return info.value.reason


def _nodes(node: Node) -> dict[str, Any]:
    return {n.id: n for n in node.status().nodes}


def _covers(assignment: dict[str, list[tuple[int, int]]], total: int) -> bool:
    ranges = sorted((o, n) for rs in assignment.values() for o, n in rs)
    pos = 0
    for off, length in ranges:
        if off != pos or length <= 0:
            return False
        pos += length
    return pos == total


def test_first_trainer_joiner_plan_ready_and_refusals(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.start(3)
    # nobody trains yet: the sync policy is empty and a trainer without state has no source
    assert _policy(n1).sync is not None and _policy(n1).sync.nodes == []  # type: ignore[union-attr]
    assert _refusal(n2, has_state=False) == "no_state_source"

    # rule 2: the first trainer with a state gets a policy of itself
    epoch1, data1, shard1 = _register(n1, True, SIZES)
    p = wait_until(lambda: (q := _policy(n1)).epoch >= epoch1 and q, "n1's policy")
    assert p.sync is not None and p.sync.nodes == ["n1"] and p.sync.kind == "single"
    assert p.sync.addresses == {"n1": data1}
    # rule 3: a second state is refused while n1 trains
    assert _refusal(n3, has_state=True, sizes=SIZES) == "state_conflict"

    # rule 3: a trainer without state gets the replication plan; n1 is its training neighbour
    epoch2, data2, _ = _register(n2, False, data=_ep("n2-data"))
    assert epoch2 > epoch1
    p2 = wait_until(lambda: (q := _policy(n2)).epoch >= epoch2 and q, "n2's policy")
    assert p2.apply_at == "after_allreduce"
    assert p2.sync is not None and sorted(p2.sync.nodes) == ["n1", "n2"]  # n3 has no trainer
    assert p2.sync.addresses == {"n1": data1, "n2": data2}
    rep = p2.replication
    assert rep is not None and rep.target == "n2" and not rep.skipped
    assert rep.donor_addresses == {"n1": shard1}
    assert [d.id for d in rep.donors] == ["n1"] and rep.donors[0].trans_s_per_byte > 0
    assert rep.tensor_sizes == SIZES
    assert set(rep.assignment) <= {"n1"} and _covers(rep.assignment, sum(SIZES))
    # every member (also n3, which does not train) has the same policy, and sees the trainers
    p3 = wait_until(lambda: (q := _policy(n3)).epoch >= epoch2 and q, "n3's policy")
    assert p3.sync is not None and "n3" not in p3.sync.nodes
    view = _nodes(n3)
    assert (view["n1"].trainer, view["n2"].trainer, view["n3"].trainer) == (
        "training",
        "syncing",
        "none",
    )
    assert view["n1"].data_address == data1 and view["n1"].shard_address == shard1
    assert view["n3"].data_address is None

    # rule 4: ready marks n2 training and logs the scale-out with its delay
    with _trainer(n2) as c:
        assert c.trainer_event(TrainerReady(elapsed_s=0.25, detail="pulled"), timeout_s=10.0).ok
    assert _nodes(n1)["n2"].trainer == "training"  # the scheduler's view of now
    done = [e for e in n1.events() if e["event"] == "scale_out_complete"]
    assert len(done) == 1 and done[0]["peer"] == "n2" and done[0]["donors"] == ["n1"]
    assert done[0]["delay_s"] is not None and done[0]["delay_s"] >= 0
    assert done[0]["trainer_elapsed_s"] == 0.25 and done[0]["multi_hop"] is False
    # a ready from a node without trainer is refused; the daemon keeps serving
    with _trainer(n3) as c, pytest.raises(RequestRefused, match="bad_request"):
        c.trainer_event(TrainerReady(), timeout_s=10.0)

    # rule 1: a re-registration that changes only the sizes updates the layout, same epoch
    commits = len([e for e in n1.events() if e["event"] == "committed"])
    new_sizes = [*SIZES, 77, 77]
    epoch3, _, _ = _register(n1, True, new_sizes, data=data1, shard=shard1)
    assert len([e for e in n1.events() if e["event"] == "committed"]) == commits
    # ... and the next joiner is planned on the new layout, from its training neighbours
    epoch4, _, _ = _register(n3, False)
    assert epoch4 > epoch3
    p3 = wait_until(lambda: (q := _policy(n3)).epoch >= epoch4 and q, "n3's new policy")
    rep = p3.replication
    assert rep is not None and rep.target == "n3" and rep.tensor_sizes == new_sizes
    assert set(rep.donor_addresses) == {"n1", "n2"} and _covers(rep.assignment, sum(new_sizes))
    assert p3.sync is not None and sorted(p3.sync.nodes) == ["n1", "n2", "n3"]

    # the CLI shows the trainer column and the JSON the data-plane fields
    res = cluster.cli(n3, "status")
    assert res.returncode == 0, res.stderr
    assert "TRAINER" in res.stdout and "syncing" in res.stdout
    res = cluster.cli(n3, "status", "--json")
    nodes = {n["id"]: n for n in json.loads(res.stdout)["nodes"]}
    assert nodes["n1"]["data_address"] == data1 and nodes["n1"]["trainer"] == "training"
    assert nodes["n3"]["shard_address"] is not None
    assert not any(e["event"] == "handler_error" for n in (n1, n2, n3) for e in n.events())


def test_a_failed_step_without_a_failure_gets_a_restart_epoch(cluster: Cluster) -> None:
    """An allreduce that failed while every member is alive (e.g. a round that timed out) gets a
    restart epoch; a report about an older epoch, or about a peer the failure detector will
    remove, commits nothing."""
    n1, n2 = cluster.start(2)
    _register(n1, True, SIZES)
    epoch, _, _ = _register(n2, False)
    with _trainer(n2) as c:
        assert c.trainer_event(TrainerReady(elapsed_s=0.1), timeout_s=10.0).ok
    cur = wait_until(lambda: (q := _policy(n2)).epoch >= epoch and q.epoch, "n2's policy")

    def restarts() -> list[dict[str, Any]]:
        commits = [e for e in n1.events() if e["event"] == "committed"]
        return [e for e in commits if e["cause"] == "allreduce_restart"]

    with _trainer(n2) as c:  # stale: a newer epoch exists already
        assert c.trainer_event(StepFailed(detail="n1", epoch=cur - 1), timeout_s=10.0).ok
    assert restarts() == []
    with _trainer(n2) as c:
        assert c.trainer_event(StepFailed(detail="n1", epoch=cur), timeout_s=10.0).ok
    done = restarts()
    assert len(done) == 1 and done[0]["epoch"] == cur + 1
    assert done[0]["restart_allreduce"] is True and done[0]["apply_at"] == "before_next_allreduce"
    p = wait_until(lambda: (q := _policy(n2)).epoch > cur and q, "the restart policy")
    assert p.sync is not None and sorted(p.sync.nodes) == ["n1", "n2"]
    # the other member's report of the same failed round finds the restart already there
    with _trainer(n1) as c:
        assert c.trainer_event(StepFailed(detail="n2", epoch=cur), timeout_s=10.0).ok
    assert len(restarts()) == 1


def test_no_state_source_until_a_layout_is_known(cluster: Cluster) -> None:
    n1, n2 = cluster.start(2)
    _register(n1, True, None)  # a trainer with state but no sizes yet (Adam's lazy state)
    wait_until(lambda: (_policy(n1).sync or _policy(n2).sync).nodes == ["n1"], "n1 trains")  # type: ignore[union-attr]
    assert _refusal(n2, has_state=False) == "no_state_source"
    _register(n1, True, SIZES, data="ipc:///tmp/chaos-n1-data", shard="ipc:///tmp/chaos-n1-shard")
    epoch, _, _ = _register(n2, False)
    p = wait_until(lambda: (q := _policy(n2)).epoch >= epoch and q, "n2's policy")
    assert p.replication is not None and p.replication.donor_addresses == {
        "n1": "ipc:///tmp/chaos-n1-shard"
    }
    assert p.sync is not None and p.sync.addresses["n1"] == "ipc:///tmp/chaos-n1-data"


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"data_address": "http://127.0.0.1:5"}, "malformed"),
        ({"shard_address": "tcp://no-port"}, "malformed"),
        ({"tensor_sizes": [-1, 5]}, "malformed"),
        ({"tensor_sizes": [1] * (MAX_STATE_TENSORS + 1)}, "malformed"),
        ({"tensor_sizes": [0, 0]}, "bad_request"),
    ],
)
def test_bad_registration_is_refused_and_the_daemon_keeps_serving(
    cluster: Cluster, fields: dict[str, Any], reason: str
) -> None:
    n1 = cluster.spawn("n1")
    good: dict[str, Any] = {
        "data_address": _ep("tcp"),
        "shard_address": _ep("tcp"),
        "has_state": True,
        "tensor_sizes": SIZES,
    }
    with _trainer(n1) as c:
        with pytest.raises(RequestRefused) as info:
            c.op(TrainerRegister(**{**good, **fields}))
        assert info.value.reason == reason
        with pytest.raises(RequestRefused, match="malformed"):
            c.op(TrainerReady(step=-1))  # a step below 0: refused by the schema
        assert n1.alive() and c.status().state == "active"
        assert c.policy().sync.nodes == []  # type: ignore[union-attr]  # nothing registered
        assert c.op(TrainerRegister(**good)).ok


def test_registration_survives_kill9_of_the_scheduler(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.start(3)
    _, data2, shard2 = _register(n2, True, SIZES)
    _, data3, shard3 = _register(n3, False)
    with _trainer(n3) as c:
        c.trainer_event(TrainerReady(elapsed_s=1.0), timeout_s=10.0)
    cluster.kill9(n1)

    def new_scheduler() -> Node | None:
        for n in (n2, n3):
            st = n.status()
            if st.role == "scheduler" and "n1" not in {x.id for x in st.nodes}:
                return n
        return None

    sched = wait_until(new_scheduler, "a new scheduler without n1")
    view = _nodes(sched)
    assert (view["n2"].trainer, view["n2"].data_address, view["n2"].shard_address) == (
        "training",
        data2,
        shard2,
    )
    assert (view["n3"].trainer, view["n3"].data_address, view["n3"].shard_address) == (
        "training",
        data3,
        shard3,
    )
    p = wait_until(
        lambda: (q := _policy(n2)).sync is not None and sorted(q.sync.nodes) == ["n2", "n3"] and q,
        "the policy of the survivors",
    )
    assert p.sync is not None and p.sync.addresses == {"n2": data2, "n3": data3}
    # the layout survived too: a new trainer without state is planned on it
    n4 = cluster.spawn("n4", join=n2, neighbors=("n2",))
    wait_until(lambda: "n4" in {x.id for x in sched.status().nodes}, "n4 admitted")
    epoch, _, _ = _register(n4, False)
    p4 = wait_until(lambda: (q := _policy(n4)).epoch >= epoch and q, "n4's policy")
    rep = p4.replication
    assert rep is not None and rep.target == "n4" and rep.tensor_sizes == SIZES
    assert rep.donor_addresses == {"n2": shard2} and _covers(rep.assignment, sum(SIZES))


# ----------------------------------------------------------------- scheduler rules, in process


def _scheduler_role() -> tuple[Any, Recorder]:
    """A scheduler ``a`` over the path a - b - c - d (b and c: no trainer yet)."""
    from chaos.daemon.config import DaemonConfig
    from chaos.daemon.scheduler.role import SchedulerRole

    from chaos.protocol.states import NodeState

    cfg = DaemonConfig(node_id="a", listen="tcp://127.0.0.1:1")
    ctx, host = recording_context(cfg)
    role = SchedulerRole(ctx, None, 0.0)
    for i, n in enumerate("bcd"):
        role.monitor.add_node(n, f"tcp://127.0.0.1:{10 + i}", NodeState.ACTIVE, 0.0)
    role.monitor.set_link("a", "b", latency_s=0.001, bandwidth_bps=1e9)
    role.monitor.set_link("b", "c", latency_s=0.002, bandwidth_bps=2e8)
    role.monitor.set_link("c", "d", latency_s=None, bandwidth_bps=None)
    return role, host


def _info(node: str, has_state: bool, sizes: list[int] | None = None, port: int = 1) -> Any:
    from chaos.protocol import TrainerInfo

    return TrainerInfo(
        sender=node,
        node_id=node,
        data_address=f"tcp://{node}:{port}",
        shard_address=f"ipc:///tmp/{node}-{port}",
        has_state=has_state,
        tensor_sizes=sizes,
        op_id=f"op-{node}",
    )


def test_multi_hop_donors_carried_plans_and_restarts() -> None:
    role, host = _scheduler_role()
    role.trainers.on_info(_info("a", True, SIZES), None, 1.0)
    assert host.answers[-1].ok and host.updates[-1].sync.nodes == ["a"]
    # c's neighbours (b, d) do not train: the donor is a, two hops away, over the path's
    # bottleneck bandwidth and summed latency
    role.trainers.on_info(_info("c", False), None, 2.0)
    upd = host.updates[-1]
    rep = upd.replication
    assert host.answers[-1].ok and upd.cause == "trainer_scale_out"
    assert rep.donor_addresses == {"a": "ipc:///tmp/a-1"} and _covers(rep.assignment, sum(SIZES))
    (donor,) = rep.donors
    assert donor.trans_s_per_byte == pytest.approx(8 / 2e8)
    assert donor.prop_s == pytest.approx(0.003)
    planned = [f for name, f in host.events if name == "replication_planned"]
    assert planned[-1]["multi_hop"] is True
    # the sync policy joins a and c over b, which has no trainer and is not in it
    assert upd.sync.nodes == ["a", "c"] and upd.sync.bottleneck_bps == pytest.approx(2e8)
    assert upd.sync.addresses == {"a": "tcp://a:1", "c": "tcp://c:1"}
    # a later commit (here a failure elsewhere) still carries c's plan until c is ready
    role.monitor.remove_node("d")
    role.ledger.commit("scale_in_failure", 3.0, apply_at="before_next_allreduce", restart=True)
    assert host.updates[-1].replication == rep
    ready = TrainerReady(sender="c", node_id="c", elapsed_s=0.5, op_id="r")
    role.trainers.on_event(ready, None, 4.0)
    done = [f for name, f in host.events if name == "scale_out_complete"]
    assert done == [
        {
            "peer": "c",
            "delay_s": 2.0,
            "trainer_elapsed_s": 0.5,
            "donors": ["a"],
            "multi_hop": True,
        }
    ]
    role.ledger.commit("link_measured", 5.0)
    assert host.updates[-1].replication is None
    # a's trainer restarts at new endpoints with its state: a new epoch names them
    epoch = role.epoch
    role.trainers.on_info(_info("a", True, SIZES, port=2), None, 6.0)
    assert role.epoch == epoch + 1 and host.updates[-1].cause == "trainer_moved"
    assert host.updates[-1].sync.addresses["a"] == "tcp://a:2"
    # c's trainer restarts without its state: it syncs again, from a
    role.trainers.on_info(_info("c", False, port=3), None, 7.0)
    assert host.answers[-1].ok and role.monitor.trainer("c").value == "syncing"
    assert host.updates[-1].replication.donor_addresses == {"a": "ipc:///tmp/a-2"}


def _join_one_by_one(role: Any, nodes: str, t0: float) -> None:
    """Each node's trainer joins without state and reports ready before the next registers (one
    joiner enters the data plane at a time)."""
    for t, n in enumerate(nodes):
        role.trainers.on_info(_info(n, False), None, t0 + t)
        ready = TrainerReady(sender=n, node_id=n, elapsed_s=0.1, op_id=f"r-{n}")
        role.trainers.on_event(ready, None, t0 + t + 0.5)


def _step_failed(role: Any, host: Recorder, node: str, peer: str, epoch: int, now: float) -> None:
    """``node``'s trainer reports a failed step of ``epoch`` blaming ``peer``; it is answered."""
    msg = StepFailed(sender=node, epoch=epoch, detail=peer, op_id=f"op-{node}-{peer}-{now}")
    role.trainers.on_event(msg, None, now)
    if not host.answers[-1].ok:
        raise AssertionError(f"step_failed refused: {host.answers[-1]}")


def _restarts(host: Recorder) -> int:
    return sum(1 for u in host.updates if u.cause == "allreduce_restart")


def test_restarts_that_keep_failing_on_one_peer_are_damped_and_shown() -> None:
    """A peer that stays heard while every rerun fails on it (a hung trainer) gets a restart
    held twice as long each time, an event, and a line in the scheduler's ``status``."""
    role, host = _scheduler_role()
    role.trainers.on_info(_info("a", True, SIZES), None, 1.0)
    role.trainers.on_info(_info("b", False), None, 2.0)
    hold_s = role.cfg.failure_timeout_s
    now = 10.0
    _step_failed(role, host, "a", "b", role.epoch, now)
    holds = []
    for _ in range(4):
        role.last_heard["b"] = now
        _step_failed(role, host, "a", "b", role.epoch, now + 0.01)
        due = role.trainers.held["b"][0]
        holds.append(round(due - now, 6))
        role.last_heard["b"] = due
        role.tick(due)
        now = due
    assert holds == [hold_s, 2 * hold_s, 4 * hold_s, 8 * hold_s]
    repeated = [f for name, f in host.events if name == "restart_repeated"]
    assert repeated[-1]["peer"] == "b" and repeated[-1]["restarts"] == 5
    assert any("failing on b" in n for n in role.trainers.notes())


def test_a_step_that_fails_again_on_the_same_peer_waits_for_the_failure_detector() -> None:
    """A peer killed a moment ago is still heard, and every rerun fails at once on it. The first
    failure gets a restart epoch; a failure in that epoch blaming the same peer holds the next
    restart back until ``failure_timeout_s`` after the first (not one epoch per failed rerun).
    A held restart is committed when due if the peer is still a member and heard, and not at all
    once it went silent."""

    role, host = _scheduler_role()
    role.trainers.on_info(_info("a", True, SIZES), None, 1.0)
    _join_one_by_one(role, "bcd", 2.0)
    hold_s = role.cfg.failure_timeout_s

    def failed(node: str, peer: str, epoch: int, now: float) -> None:
        _step_failed(role, host, node, peer, epoch, now)

    def restarts() -> int:
        return _restarts(host)

    t0 = 10.0
    failed("b", "c", role.epoch, t0)
    first = role.epoch
    assert restarts() == 1 and host.updates[-1].restart_allreduce
    # every member's rerun in the restart epoch fails at once on c again: no epoch is committed
    for i, n in enumerate("abd" * 5):
        failed(n, "c", first, t0 + 0.01 * (i + 1))
    assert restarts() == 1 and role.epoch == first
    held = [f for name, f in host.events if name == "restart_held"]
    assert len(held) == 1 and held[0]["peer"] == "c" and held[0]["epoch"] == first
    role.tick(t0 + hold_s * 0.5)
    assert restarts() == 1
    # c is still heard when the hold ends (the failure was not c's death): one restart
    role.last_heard["c"] = t0 + hold_s
    role.tick(t0 + hold_s + 0.01)
    assert restarts() == 2 and role.epoch == first + 1 and not role.trainers.held
    # it fails again in that epoch, and c falls silent before the hold ends: no restart (the
    # failure detector removes c, which commits the next epoch)
    second = role.epoch
    failed("b", "c", second, t0 + hold_s + 0.1)
    assert restarts() == 2 and role.trainers.held
    role.tick(t0 + 4 * hold_s)  # a second restart in a row on c is held twice as long
    assert restarts() == 2 and role.epoch == second and not role.trainers.held
    # a failure blaming another peer is not held back by c's restarts
    failed("b", "d", second, t0 + 3 * hold_s + 0.01)
    assert restarts() == 3


def test_a_late_heartbeat_holds_the_restart_and_the_scheduler_is_never_silent() -> None:
    """A failed step blaming a peer whose heartbeat is late is held until the failure detector
    has had its turn, then restarted if the peer is heard again (it was only late, on a busy
    host). A step blaming the scheduler restarts at once however long ago it stamped itself
    heard: it is the one answering."""

    role, host = _scheduler_role()
    role.trainers.on_info(_info("a", True, SIZES), None, 1.0)
    _join_one_by_one(role, "bcd", 2.0)
    cfg = role.cfg

    def failed(peer: str, now: float) -> None:
        _step_failed(role, host, "b", peer, role.epoch, now)

    def restarts() -> int:
        return _restarts(host)

    t0 = 10.0
    role.last_heard["a"] = t0 - 10 * cfg.heartbeat_interval_s  # the scheduler's own stamp
    failed("a", t0)
    assert restarts() == 1 and not role.trainers.held
    # c's heartbeat is two intervals late: held, not dropped
    role.last_heard["c"] = t0 - 2 * cfg.heartbeat_interval_s
    failed("c", t0 + 0.01)
    assert restarts() == 1 and "c" in role.trainers.held
    held = [f for name, f in host.events if name == "restart_held"]
    due = role.last_heard["c"] + cfg.failure_timeout_s + cfg.heartbeat_interval_s
    assert held[-1]["peer"] == "c" and held[-1]["due_in_s"] == pytest.approx(due - t0 - 0.01)
    role.tick(due - 0.01)  # not yet due
    assert restarts() == 1
    role.last_heard["c"] = due - 0.01  # heard again before the hold ended
    role.tick(due)
    assert restarts() == 2 and not role.trainers.held


def test_a_report_after_the_rebuild_that_changes_a_trainer_commits_an_epoch() -> None:
    """A new scheduler commits its rebuild at the deadline without the reports still missing.
    A report that comes later and says a trainer became ``training`` (it sent ``ready`` just
    before the election) commits a new epoch; the same report again commits nothing."""
    from chaos.daemon.scheduler.role import SchedulerRole

    from chaos.protocol import AgentReport

    old, _ = _scheduler_role()
    old.trainers.on_info(_info("a", True, SIZES), None, 1.0)
    old.trainers.on_info(_info("b", False), None, 2.0)
    view = old.monitor.to_view(old.epoch, 1, "a")
    ctx, host = recording_context(old.cfg)
    role = SchedulerRole(ctx, view, 10.0)
    assert role.monitor.trainer("b").value == "syncing"
    deadline = 10.0 + role.cfg.failure_timeout_s
    for m in "bcd":  # every member is heard; none has reported yet
        role.on_heartbeat(m, None, deadline - 0.1)
    role.check_failures(deadline + 0.01)
    assert [u.cause for u in host.updates] == ["reelection"]

    def report(now: float) -> None:
        msg = AgentReport(sender="b", epoch=view.epoch, term=1, address="tcp://127.0.0.1:10",
                          joined_at=0.0, data_address="tcp://b:1",
                          shard_address="ipc:///tmp/b-1", trainer="training")  # fmt: skip
        role.on_agent_report(msg, now)

    report(deadline + 0.1)
    assert [u.cause for u in host.updates] == ["reelection", "trainer_report"]
    assert role.monitor.trainer("b").value == "training"
    report(deadline + 0.2)
    assert len(host.updates) == 2


def test_a_rebuild_that_drops_a_failed_member_restarts_the_allreduce() -> None:
    """A new scheduler whose rebuild finds a member failed (often the former scheduler, cut
    off) commits the rebuilt view with a restart, as a scale-in does: the trainers' round in
    flight waits on that member (a soak's survivors waited 10 s on a cut-off scheduler). A
    rebuild that lost nobody does not restart."""
    from chaos.daemon.scheduler.role import SchedulerRole

    for silent, restart in (("", False), ("d", True)):
        old, _ = _scheduler_role()
        old.trainers.on_info(_info("a", True, SIZES), None, 1.0)  # an epoch to take over
        view = old.monitor.to_view(old.epoch, 1, "a")
        ctx, host = recording_context(old.cfg)
        role = SchedulerRole(ctx, view, 10.0)
        deadline = 10.0 + role.cfg.failure_timeout_s
        for m in "bcd":
            if m != silent:
                role.on_heartbeat(m, None, deadline - 0.1)
        role.check_failures(deadline + 0.01)
        assert [u.cause for u in host.updates] == ["reelection"], silent
        assert host.updates[0].restart_allreduce is restart, silent
        active = {n.id for n in host.updates[0].view.nodes if n.state == "active"}
        assert ("d" in active) is not restart


def test_a_link_measurement_commits_an_epoch_only_when_it_changes_the_sync_policy() -> None:
    from chaos.protocol import LinkReport

    role, host = _scheduler_role()
    role.trainers.on_info(_info("a", True, SIZES), None, 1.0)
    _join_one_by_one(role, "bcd", 2.0)
    role.monitor.set_link("c", "d", latency_s=0.001, bandwidth_bps=1e9)  # b-c is the bottleneck
    role.monitor.set_link("a", "c", latency_s=0.001, bandwidth_bps=None)  # a new link, unmeasured
    role.ledger.commit("connect_link", 6.0)
    before = host.updates[-1].sync
    epoch, commits = role.epoch, len(host.updates)

    def measured(bw: float, op_id: str = "refine-1", sender: str = "a", peer: str = "c") -> None:
        report = LinkReport(sender=sender, epoch=role.epoch, term=1, peer=peer, up=True,
                            latency_s=0.001, bandwidth_bps=bw, op_id=op_id)  # fmt: skip
        role.on_link_report(report, 7.0)

    def check_probes(since: int) -> dict[tuple[str, str], str]:
        """The probes the scheduler ordered after ``since`` sends: (node, peer) -> op id."""
        out = {}
        for node, cmd in host.sent[since:]:
            assert cmd.measure_bandwidth and cmd.op_id.startswith("confirm-")
            out[(node, cmd.peer)] = str(cmd.op_id)
        return out

    # a slow measurement: the max-bottleneck tree keeps b-c, so the trainers' policy is the same
    # and no epoch is committed; the monitor has the figure and the event log says so
    measured(1e6)
    assert role.epoch == epoch and len(host.updates) == commits
    assert role.monitor.link("a", "c")["bandwidth_bps"] == pytest.approx(1e6)
    refined = [f for name, f in host.events if name == "link_refined"]
    assert refined[-1]["a"] == "a" and refined[-1]["b"] == "c" and refined[-1]["epoch"] == epoch
    # 10% faster than b-c: the max-bottleneck tree would swap b-c for a-c, but that gains less
    # than sync_switch_min_gain (20%), so the structure in force stays and no epoch is committed
    measured(2.2e8)
    assert role.epoch == epoch and len(host.updates) == commits
    # a fast one would change the tree (a-c replacing the 5x slower b-c), but one probe is not
    # trusted with that: the figure is held back, and a second probe of a-c and a fresh one of
    # b-c (the link the new tree drops) are ordered together
    sent = len(host.sent)
    measured(1e10)
    probes = check_probes(sent)
    assert set(probes) == {("a", "c"), ("b", "c")}
    assert role.epoch == epoch and len(host.updates) == commits
    assert role.monitor.link("a", "c")["bandwidth_bps"] == pytest.approx(2.2e8)
    confirming = [f for name, f in host.events if name == "link_confirming"][-1]
    assert confirming["bandwidth_bps"] == 1e10 and confirming["rechecked"] == [["b", "c"]]
    # the second probe measures a-c slow (the first was noise): nothing is decided until b-c's
    # probe is in too; then the lower figure is kept, and nothing is committed
    measured(1e6, probes[("a", "c")])
    assert role.monitor.link("a", "c")["bandwidth_bps"] == pytest.approx(2.2e8)
    assert role.checks.pending
    measured(2e8, probes[("b", "c")], sender="b")
    assert role.epoch == epoch and len(host.updates) == commits and not role.checks.pending
    assert role.monitor.link("a", "c")["bandwidth_bps"] == pytest.approx(1e6)
    # fast twice, but b-c, measured beside it, is as fast: the first figure of b-c was taken
    # on a busier host, not a slower link; both take their fresh figures, and the tree stays
    sent = len(host.sent)
    measured(1e10)
    probes = check_probes(sent)
    measured(5e9, probes[("b", "c")], sender="b")
    measured(6e9, probes[("a", "c")])
    assert role.epoch == epoch and len(host.updates) == commits
    assert role.monitor.link("b", "c")["bandwidth_bps"] == pytest.approx(5e9)
    assert role.monitor.link("a", "c")["bandwidth_bps"] == pytest.approx(6e9)
    # a-c fast twice and b-c still slow: a new epoch is committed with a-c's lower figure
    role.monitor.set_bandwidth("b", "c", 2e8)
    sent = len(host.sent)
    measured(2e10)
    probes = check_probes(sent)
    measured(1e10, probes[("a", "c")])
    measured(2e8, probes[("b", "c")], sender="b")
    assert role.epoch == epoch + 1 and host.updates[-1].cause == "link_measured"
    assert role.monitor.link("a", "c")["bandwidth_bps"] == pytest.approx(1e10)
    after = host.updates[-1].sync
    assert (after.parents, after.ring) != (before.parents, before.ring)
    # a late answer to a confirming probe that was forgotten is an ordinary measurement
    measured(1e6, "confirm-unknown")
    assert role.epoch == epoch + 1


def test_a_commit_that_keeps_the_structure_keeps_the_topology_epoch() -> None:
    role, host = _scheduler_role()
    role.trainers.on_info(_info("a", True, SIZES), None, 1.0)
    _join_one_by_one(role, "bcd", 2.0)
    first = host.updates[-1].sync
    assert first.topology_epoch == role.epoch  # a new structure: its own epoch
    # a slow new link that no tree uses: a new membership epoch, the same structure epoch
    role.monitor.set_link("a", "c", latency_s=0.001, bandwidth_bps=1e3)
    role.ledger.commit("connect_link", 6.0)
    kept = host.updates[-1].sync
    assert host.updates[-1].epoch == first.topology_epoch + 1
    assert kept.topology_epoch == first.topology_epoch and kept.parents == first.parents
    # a restart always gets a new structure epoch, even with the same structure
    role.ledger.commit("allreduce_restart", 7.0, apply_at="before_next_allreduce", restart=True)
    assert host.updates[-1].sync.topology_epoch == role.epoch
    restart_epoch = role.epoch
    # a step that failed under the restart's structure gets another restart, even after a
    # commit that kept the structure (that one would not rerun the step)
    role.ledger.commit("connect_link", 8.0)
    assert host.updates[-1].sync.topology_epoch == restart_epoch
    failed = StepFailed(sender="b", node_id="b", epoch=restart_epoch, detail="c", op_id="f")
    role.last_heard["c"] = 8.0
    role.trainers.on_event(failed, None, 8.0)
    assert host.updates[-1].cause == "allreduce_restart" and role.epoch == restart_epoch + 2
    # one reported under an older structure epoch than the newest one is answered, not restarted
    stale = StepFailed(sender="b", node_id="b", epoch=restart_epoch - 1, detail="c", op_id="g")
    role.trainers.on_event(stale, None, 8.5)
    assert role.epoch == restart_epoch + 2


def test_failures_are_removed_one_per_commit() -> None:
    """Raft's single-server change: two silent members are not removed in one commit, so a
    minority cannot commit a membership whose majority it is."""
    from chaos.protocol import PolicyAck
    from chaos.protocol.states import NodeState

    role, host = _scheduler_role()
    role.monitor.add_node("e", "tcp://127.0.0.1:20", NodeState.ACTIVE, 0.0)
    role.monitor.set_link("d", "e", latency_s=0.001, bandwidth_bps=1e9)
    role.ledger.commit("scale_out", 0.5)
    for m in "abcde":
        role.on_ack(PolicyAck(sender=m, epoch=role.epoch, term=1), 0.6)
    assert role.stable_members == frozenset("abcde")
    for m in "abc":
        role.last_heard[m] = 10.0
    role.last_heard["d"], role.last_heard["e"] = 8.0, 8.2  # both silent past the timeout
    role.check_failures(10.0)
    assert host.updates[-1].cause == "scale_in_failure"
    assert [n.id for n in host.updates[-1].view.nodes] == ["a", "b", "c", "e"]  # d, longest
    epoch = role.epoch
    role.check_failures(10.1)  # e waits until a majority acknowledged the removal of d
    assert role.epoch == epoch
    for m in "abc":
        role.on_ack(PolicyAck(sender=m, epoch=epoch, term=1), 10.2)
    role.check_failures(10.3)
    assert role.epoch == epoch + 1
    assert [n.id for n in host.updates[-1].view.nodes] == ["a", "b", "c"]


def test_the_daemon_publishes_its_epoch_to_trainers(cluster: Cluster) -> None:
    """A trainer learns of a new epoch from the daemon's notices, without asking."""
    from chaos.trainer.policy_watch import PolicyWatch

    n1, n2 = cluster.start(2)
    p = _policy(n2)
    assert p.notify_address is not None and p.notify_address.startswith("ipc://")
    watch = PolicyWatch(p.notify_address)
    try:
        # notices come at least every heartbeat interval, so the watch hears one soon
        wait_until(lambda: not watch.needs_fetch(p.epoch, time.monotonic()), "a notice")
        assert watch.latest_epoch == p.epoch
        epoch, _, _ = _register(n1, True, SIZES)  # a commit: every member installs it

        # n2's trainer, still at the old epoch, would ask now (needs_fetch drains the notices)
        def heard() -> bool:
            return watch.needs_fetch(p.epoch, time.monotonic()) and watch.latest_epoch >= epoch

        wait_until(heard, "the notice of the new epoch")
        assert not watch.needs_fetch(watch.latest_epoch, time.monotonic())
        # the notice of the change carried the policy: the trainer needs no round trip
        carried = watch.carried(p.epoch)
        assert carried is not None and carried.epoch == watch.latest_epoch
        assert carried == _policy(n2)  # what asking would have given
    finally:
        watch.close()


def test_a_leaving_scheduler_answers_the_leavers_it_committed_and_hands_over_fresh() -> None:
    """The end of a run: the scheduler's own leave completes while another member's leave is
    committed but not yet acknowledged by everyone. The scheduler exits right after, so it
    answers that leaver at once, and its handover carries the epoch of its last commit (an
    older one would be refused as stale)."""
    from chaos.protocol import LeaveRequest, PolicyAck, TimeoutNow

    role, host = _scheduler_role()
    role.on_leave(LeaveRequest(sender="a", node_id="a", op_id="own"), None, 1.0)
    role.on_leave(LeaveRequest(sender="c", node_id="c", op_id="op-c"), object(), 1.0)
    assert role.epoch == 2 and not host.answers  # nobody has acknowledged anything yet
    for m in ("b", "d"):  # the first view (without a) is acknowledged, the second is not
        role.on_ack(PolicyAck(sender=m, epoch=1, term=1), 1.1)
    results = {r.op_id: r for r in host.answers}
    assert results["own"].ok and results["op-c"].ok
    handovers = [(p, m) for p, m in host.sent if isinstance(m, TimeoutNow)]
    assert handovers == [("b", TimeoutNow(sender="a", epoch=2, term=1))]


def test_one_joiner_enters_the_data_plane_at_a_time() -> None:
    """While one joiner's entry waits for its ready, or one joiner replays (catch-up), another
    joiner's registration is refused ``overloaded`` (its trainer asks again), and so is another
    joiner's caught_up during an entry: a later plan would replace the first joiner's in the
    commits that follow, donors that skip an entering joiner's epoch would never serve it, and
    donors would drop a replaying joiner's snapshot and step log."""
    import msgspec
    from chaos.daemon.scheduler.registry import ENTRY_EXCLUSIVE_S

    role, host = _scheduler_role()
    role.trainers.on_info(_info("a", True, SIZES), None, 1.0)
    for step in (5, 9, 12):  # a's step clock: catch-up joins can be planned
        role.monitor.observe_progress("a", step, False, 0.03, 1.0 + 0.1 * step + 0.03)

    def ready(node: str, now: float) -> None:
        msg = TrainerReady(sender=node, node_id=node, elapsed_s=0.5, op_id=f"r{now}")
        role.trainers.on_event(msg, None, now)
        assert host.answers[-1].ok

    role.trainers.on_info(_info("c", False), None, 2.0)  # a barrier join: c enters at once
    assert host.answers[-1].ok and host.updates[-1].replication.target == "c"
    epoch = role.epoch
    catch_up_b = msgspec.structs.replace(_info("b", False), catch_up=True)
    role.trainers.on_info(catch_up_b, None, 2.5)
    refused = host.answers[-1]
    assert not refused.ok and refused.reason == "overloaded" and "c is entering" in refused.detail
    assert role.epoch == epoch and role.monitor.trainer("b").value == "none"

    ready("c", 3.0)
    role.trainers.on_info(catch_up_b, None, 3.1)  # asked again: b catches up (members train on)
    assert host.answers[-1].ok and host.updates[-1].cause == "trainer_catch_up"
    b_plan = host.updates[-1].replication
    assert b_plan.target == "b" and b_plan.at_step is not None
    # while b replays, nobody else's plan may replace its snapshot plan in the commits: c's
    # trainer restarts without its state (a barrier join), d asks to catch up; both wait
    epoch = role.epoch
    role.trainers.on_info(_info("c", False, port=3), None, 3.2)
    refused = host.answers[-1]
    assert refused.reason == "overloaded" and "b is catching up" in refused.detail
    role.trainers.on_info(msgspec.structs.replace(_info("d", False), catch_up=True), None, 3.25)
    assert host.answers[-1].reason == "overloaded" and role.epoch == epoch
    assert role.trainers.carried() == b_plan  # a commit now (e.g. a failure) still carries it
    caught_up = CaughtUp(sender="b", node_id="b", op_id="cu1")
    role.trainers.on_event(caught_up, None, 3.3)  # b enters: still no one else
    assert host.answers[-1].ok and host.updates[-1].cause == "trainer_scale_out"
    assert host.updates[-1].replication.target == "b" and "b" in host.updates[-1].sync.nodes
    epoch = role.epoch
    role.trainers.on_info(_info("c", False, port=3), None, 3.4)
    assert host.answers[-1].reason == "overloaded" and "b is entering" in host.answers[-1].detail
    ready("b", 3.5)
    role.trainers.on_info(_info("c", False, port=3), None, 3.6)  # asked again: c enters
    assert host.answers[-1].ok and host.updates[-1].replication.target == "c"
    # a caught_up is not held back by another joiner that still replays (two replaying
    # joiners, as a newly elected scheduler may find them, would otherwise wait on each other)
    ready("c", 3.7)
    for m in "abc":  # every possible donor's step clock
        for step in (30, 31):
            role.monitor.observe_progress(m, step, False, 0.03, 3.0 + 0.02 * step)
    role.trainers.on_info(msgspec.structs.replace(_info("d", False), catch_up=True), None, 3.8)
    assert host.answers[-1].ok and role.monitor.catching_up == {"d"}
    role.monitor.catching_up.add("c")  # c replaying too (it would hold a registration back)
    role.trainers.replaying["c"] = 3.85
    role.trainers.on_event(CaughtUp(sender="d", node_id="d", op_id="cu3"), None, 3.9)
    assert host.answers[-1].ok and host.updates[-1].replication.target == "d"
    role.monitor.catching_up.discard("c")
    role.trainers.replaying.pop("c")

    # a replaying joiner holds the line from its registration, and again from the report that
    # its snapshot is in (a large snapshot's pull does not eat into its replay's share)
    from chaos.protocol.messages import PullReport

    ready("d", 4.0)
    cu = msgspec.structs.replace(_info("d", False, port=5), catch_up=True)
    role.trainers.on_info(cu, None, 10.0)  # d's trainer restarts: it catches up again
    assert host.answers[-1].ok and role.monitor.catching_up == {"d"}
    pulled = PullDone(sender="d", node_id="d", op_id="rd", pull=PullReport(state_bytes=sum(SIZES)))
    role.trainers.on_event(pulled, None, 10.0 + ENTRY_EXCLUSIVE_S - 1.0)
    role.trainers.on_info(_info("c", False, port=4), None, 10.0 + ENTRY_EXCLUSIVE_S + 1.0)
    assert host.answers[-1].reason == "overloaded" and "d is catching up" in host.answers[-1].detail
    role.trainers.on_event(CaughtUp(sender="d", node_id="d", op_id="cu4"), None,
                           10.0 + ENTRY_EXCLUSIVE_S + 2.0)  # fmt: skip
    assert host.answers[-1].ok and host.updates[-1].replication.target == "d"
    t = 10.0 + ENTRY_EXCLUSIVE_S + 3.0

    # an entry that never reports ready holds the others back only so long
    role.trainers.on_info(_info("c", False, port=4), None, t)  # c restarts once more
    assert host.answers[-1].reason == "overloaded"
    role.trainers.on_info(_info("c", False, port=4), None, t - 1.0 + ENTRY_EXCLUSIVE_S + 0.1)
    assert host.answers[-1].ok and host.updates[-1].replication.target == "c"
