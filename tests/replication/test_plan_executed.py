"""Which plan a joiner executes (``chaos.replication.pull.choose_plan``), and the per-shard cost
its re-plans use.

The scheduler's plan runs as it is when it fits the snapshot; a runtime record that changed size
only moves the stream's end; a re-plan (a donor missing, or one dropped mid-pull) uses the
policy's measured c. The last test pulls from real shard servers over loopback.
"""

from __future__ import annotations

import torch
from chaos.scheduling import Neighbor, plan_replication

from chaos.protocol import ReplicationWire
from chaos.protocol.messages import DonorLink, merge_ranges
from chaos.replication.pull import PullConfig, choose_plan, pull_state
from chaos.replication.server import ServerFaults, ShardServer, ShardServerConfig
from chaos.replication.state import TrainingState

EPOCH, STEP = 3, 200


def _state(step: int = STEP) -> TrainingState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Linear(256, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return TrainingState.capture(model, opt, step=step, epoch=EPOCH)


def _neighbors(ids: list[str]) -> list[Neighbor]:
    return [Neighbor.from_bandwidth(i, 1e6, 1e-4, 0.0) for i in ids]  # 1 Mbit/s: 0.8 s per 100 KB


def _policy(sizes: list[int], ids: list[str], c: float, method: str = "chaos") -> ReplicationWire:
    """The scheduler's policy over ``sizes`` (what ``planner.replication_policy`` issues)."""
    plan = plan_replication(sizes, _neighbors(ids), c, "flat", method)
    return ReplicationWire(
        target="j",
        shard_size=plan.shard_size,
        assignment={k: [(o, n) for o, n in v] for k, v in plan.assignment.items()},
        makespan_s=plan.makespan_s,
        donors=[
            DonorLink(id=n.id, prop_s=n.prop_s, trans_s_per_byte=n.trans_s_per_byte)
            for n in _neighbors(ids)
        ],  # fmt: skip
        tensor_sizes=list(sizes),
        method=method,  # type: ignore[arg-type]
        per_shard_cost_s=c,
    )


def test_the_schedulers_plan_runs_as_it_is_when_it_fits() -> None:
    state = _state()
    rep = _policy(state.tensor_sizes(), ["a", "b", "c"], 2e-5)
    plan, reason = choose_plan(state, rep, _neighbors(["a", "b", "c"]))
    assert reason == ""
    assert plan.assignment == {k: list(v) for k, v in rep.assignment.items()}
    assert plan.per_shard_cost_s == 2e-5 and plan.shard_size == rep.shard_size


def test_a_runtime_record_that_grew_only_moves_the_streams_end() -> None:
    """Planned over step 127's layout, the donors serve step 128's (one byte more in the record):
    every range stays, the one that ends the stream ends one byte later."""
    old, new = _state(127), _state(128)
    assert old.tensor_sizes()[:-1] == new.tensor_sizes()[:-1]
    assert new.total_bytes == old.total_bytes + 1
    rep = _policy(old.tensor_sizes(), ["a", "b"], 1e-5)
    plan, reason = choose_plan(new, rep, _neighbors(["a", "b"]))
    assert reason == "runtime_record_resized"
    moved = {(k, i) for k, v in plan.assignment.items() for i, r in enumerate(v)
             if tuple(r) != tuple(rep.assignment[k][i])}  # fmt: skip
    assert len(moved) == 1
    (donor, i) = moved.pop()
    off, n = rep.assignment[donor][i]
    assert plan.assignment[donor][i] == (off, n + 1) and off + n == old.total_bytes
    # and back: a record that shrank cuts the last range
    plan, reason = choose_plan(old, _policy(new.tensor_sizes(), ["a", "b"], 1e-5),
                               _neighbors(["a", "b"]))  # fmt: skip
    assert reason == "runtime_record_resized"
    assert sum(n for v in plan.assignment.values() for _, n in v) == old.total_bytes


def test_a_missing_donor_or_another_layout_replans_with_the_policys_c() -> None:
    state = _state()
    rep = _policy(state.tensor_sizes(), ["a", "b", "c"], 3e-3)
    assert all(rep.assignment[d] for d in ("a", "b", "c"))
    plan, reason = choose_plan(state, rep, _neighbors(["a", "c"]))
    assert reason == "donors_missing: b"
    assert plan.per_shard_cost_s == 3e-3 and not plan.assignment.get("b")
    other = _policy([*state.tensor_sizes()[:-1], 7, state.tensor_sizes()[-1]], ["a", "b"], 3e-3)
    plan, reason = choose_plan(state, other, _neighbors(["a", "b"]))
    assert reason == "layout_changed" and plan.per_shard_cost_s == 3e-3
    assert sum(n for v in plan.assignment.values() for _, n in v) == state.total_bytes


def _pull_with_a_stalled_donor(c: float) -> tuple[int, int]:
    """Pulls from three in-process shard servers, one of which never answers a shard request;
    returns (re-plans, shards the two others sent beyond their planned ones)."""
    donor = _state()
    ids = ["a", "b", "c"]
    rep = _policy(donor.tensor_sizes(), ids, c)
    faults = {"a": ServerFaults(), "b": ServerFaults(stall_after_shards=0), "c": ServerFaults()}
    servers = {d: ShardServer(ShardServerConfig(listen="tcp://127.0.0.1:0"), faults=faults[d])
               for d in ids}  # fmt: skip
    try:
        for s in servers.values():
            s.publish(donor, EPOCH, STEP)
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.Linear(256, 64))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        joiner = TrainingState.for_joiner(model, opt, donor.manifest_bytes, reuse=False)
        plan, reason = choose_plan(joiner, rep, _neighbors(ids))
        assert reason == "" and plan.per_shard_cost_s == c and plan.assignment["b"]
        stats = pull_state(
            plan,
            {d: s.address for d, s in servers.items()},
            joiner,
            EPOCH,
            STEP,
            120.0,
            neighbors=_neighbors(ids),
            config=PullConfig(window=1, request_timeout_s=1.0),
        )
    finally:
        for s in servers.values():
            s.close(timeout_s=5.0)
    assert stats.failed_donors == {"b": "timeout"}
    assert joiner.missing() == []
    delivered = merge_ranges([r for v in stats.ranges_per_donor.values() for r in v])
    assert delivered == [(0, joiner.total_bytes)]
    extra = sum(stats.shards_per_donor[d] - len(rep.assignment[d]) for d in ("a", "c"))
    return stats.replans, extra


def test_a_replan_after_a_donor_died_uses_the_policys_measured_c() -> None:
    """With the measured c of a costly message (50 ms), the dead donor's bytes are re-planned as
    a few large shards; with c = 0 (what re-plans used before) the same pull re-plans them as
    many small ones. So the re-plan follows the policy's c."""
    replans, extra_costly = _pull_with_a_stalled_donor(0.05)
    assert replans == 1 and 1 <= extra_costly <= 2
    replans, extra_free = _pull_with_a_stalled_donor(0.0)
    assert replans == 1 and extra_free > 8 * extra_costly
