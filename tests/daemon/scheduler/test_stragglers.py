"""The straggler rule (daemon/scheduler/stragglers.py) and its wiring in the scheduler role.

Pure rules first (no sockets, no clock: times are given), then the scheduler role in process,
with a host that records what it would send: progress reports in, ``straggler_evicted`` and the
commit out, and a failed step blamed on the member that stopped.
"""

from __future__ import annotations

from typing import Any

import pytest
from chaos.daemon.scheduler.stragglers import StragglerWatch

from chaos.protocol import StepFailed, TrainerProgress, TrainerReady
from tests.daemon.recorder import Recorder, recording_context

GRACE = 2.0
ADDR = "tcp://127.0.0.1:7700"
FRESH = 0.6
ABC = ("a", "b", "c")


def _watch(grace: float = GRACE) -> StragglerWatch:
    return StragglerWatch(grace, FRESH)


def test_a_silent_member_behind_waiting_members_is_a_straggler() -> None:
    w = _watch()
    # a and b wait inside update() at step 7 for 2.5 s and are heard; c computes step 7 and
    # has been silent for 2.5 s
    w.report("a", 7, True, 2.5, 0.1, now=10.0)
    w.report("b", 7, True, 2.4, 0.05, now=10.0)
    w.report("c", 7, False, 2.5, 2.5, now=10.0)
    [s] = w.find(ABC, now=10.1)
    assert s.node == "c" and s.step == 7 and s.at_step == 7
    assert s.waiting == ("a", "b") and s.waited_s == pytest.approx(2.6)
    assert s.silent_s == pytest.approx(2.6)


def test_a_member_stopped_inside_its_allreduce_is_a_straggler_too() -> None:
    w = _watch()
    w.report("a", 3, True, 3.0, 0.1, now=5.0)
    w.report("b", 3, True, 3.0, 0.1, now=5.0)
    w.report("c", 3, True, 3.0, 2.2, now=5.0)  # inside update(), but no longer heard
    assert [s.node for s in w.find(ABC, now=5.0)] == ["c"]


def test_a_slow_member_that_is_heard_every_step_is_never_a_straggler() -> None:
    w = _watch()
    for t in range(20):  # c takes 1.5 s per step, under the grace; a and b wait for it
        now = float(t)
        w.report("a", t, True, 1.4, 0.1, now)
        w.report("b", t, True, 1.4, 0.1, now)
        w.report("c", t, False, 1.4, 1.4, now)
        assert w.find(ABC, now) == []


def test_nobody_is_a_straggler_while_nobody_waits_past_the_grace() -> None:
    w = _watch()
    # everybody computes (an evaluation every device runs): silent, but nobody waits
    for n in ABC:
        w.report(n, 4, False, 30.0, 30.0, now=1.0)
    assert w.find(ABC, now=1.0) == []
    # a waits, but not yet longer than the grace: c still has time
    w.report("a", 4, True, 1.5, 0.1, now=1.0)
    assert w.find(ABC, now=1.0) == []


def test_members_that_all_wait_and_are_heard_are_no_stragglers() -> None:
    w = _watch()
    for n in ABC:  # a link that drops its packets: everyone waits, everyone is heard
        w.report(n, 9, True, 20.0, 0.1, now=3.0)
    assert w.find(ABC, now=3.0) == []


def test_a_member_past_the_waiters_step_is_not_holding_them_up() -> None:
    w = _watch()
    w.report("a", 5, True, 3.0, 0.1, now=1.0)
    w.report("c", 6, False, 3.0, 3.0, now=1.0)  # c completed step 5
    assert w.find(ABC, now=1.0) == []


def test_stale_reports_and_members_that_do_not_train_count_for_nothing() -> None:
    w = _watch()
    w.report("a", 2, True, 3.0, 0.1, now=0.0)
    w.report("c", 2, False, 3.0, 3.0, now=0.0)
    assert [s.node for s in w.find(ABC, now=0.5)] == ["c"]
    assert w.find(ABC, now=0.5 + FRESH) == []  # no fresh report: nothing is known
    assert w.find(("a", "b"), now=0.5) == []  # c's trainer is not training (a joiner)
    w.forget("c")
    assert w.find(ABC, now=0.5) == []


def test_a_grace_of_zero_turns_the_rule_off() -> None:
    w = _watch(grace=0.0)
    w.report("a", 2, True, 300.0, 0.1, now=0.0)
    w.report("c", 2, False, 300.0, 300.0, now=0.0)
    assert w.find(ABC, now=0.0) == []


def test_blame_names_the_member_that_stopped_not_the_neighbour() -> None:
    w = _watch(grace=10.0)
    w.report("a", 2, True, 3.0, 0.1, now=0.0)
    w.report("b", 2, True, 3.0, 0.1, now=0.0)
    w.report("c", 2, False, 3.2, 3.2, now=0.0)
    # a's round timed out after 3 s waiting for b; c is the one silent since before it
    assert w.blame("a", "b", 3.0, ABC, now=0.0) == "c"
    # a short silence (a device computing its step) is not blamed
    w.report("c", 2, False, 0.4, 0.4, now=0.0)
    assert w.blame("a", "b", 3.0, ABC, now=0.0) == "b"
    # nothing known about the wait and no grace: the round's own peer
    assert StragglerWatch(0.0, FRESH).blame("a", "b", 0.0, ABC, now=0.0) == "b"


def test_a_member_stuck_a_step_behind_the_waiting_others_is_found() -> None:
    w = _watch()
    # a and b completed step 7 and wait in step 8; c, heard all along, still waits in step 7
    # (the round's last frames to it were lost): nobody is silent, the silence rule finds none
    w.report("a", 8, True, 2.5, 0.1, now=10.0)
    w.report("b", 8, True, 2.4, 0.05, now=10.0)
    w.report("c", 7, True, 2.6, 0.1, now=10.0)
    assert w.find(ABC, now=10.1) == []
    [s] = w.behind(ABC, now=10.1)
    assert s.node == "c" and s.behind and s.step == 7 and s.at_step == 8
    assert s.waiting == ("a", "b") and s.waited_s == pytest.approx(2.6)


def test_a_step_behind_counts_only_past_the_grace_and_among_the_heard() -> None:
    w = _watch()
    # a moment after a round ended, one member is still finishing it: not stuck
    w.report("a", 8, True, 0.5, 0.1, now=10.0)
    w.report("c", 7, True, 2.6, 0.1, now=10.0)
    assert w.behind(ABC, now=10.0) == []
    # a silent member is the silence rule's business; stale and non-training reports count not
    w.report("a", 8, True, 2.5, 0.1, now=10.0)
    w.report("c", 7, True, 2.6, 1.5, now=10.0)
    assert w.behind(ABC, now=10.0) == []
    w.report("c", 7, True, 2.6, 0.1, now=10.0)
    assert w.behind(("a", "b"), now=10.0) == []
    assert w.behind(ABC, now=10.0 + FRESH + 0.1) == []
    # everyone at the same step, or the rule off: nobody
    w.report("c", 8, True, 2.6, 0.1, now=10.0)
    assert w.behind(ABC, now=10.0) == []
    w.report("c", 7, True, 2.6, 0.1, now=10.0)
    assert len(w.behind(ABC, now=10.0)) == 1
    off = StragglerWatch(0.0, FRESH)
    off.report("a", 8, True, 2.5, 0.1, now=10.0)
    off.report("c", 7, True, 2.6, 0.1, now=10.0)
    assert off.behind(ABC, now=10.0) == []


def test_the_step_behind_rule_has_its_own_shorter_grace() -> None:
    w = StragglerWatch(10.0, FRESH, behind_grace_s=GRACE)
    w.report("a", 8, True, 2.5, 0.1, now=10.0)
    w.report("c", 7, True, 2.6, 0.1, now=10.0)
    assert [s.node for s in w.behind(ABC, now=10.0)] == ["c"]  # past 2 s, far from 10 s
    assert w.find(ABC, now=10.0) == []
    off = StragglerWatch(10.0, FRESH, behind_grace_s=0.0)
    off.report("a", 8, True, 12.5, 0.1, now=10.0)
    off.report("c", 7, True, 12.6, 0.1, now=10.0)
    assert off.behind(ABC, now=10.0) == []


def test_a_step_behind_grace_at_or_below_two_heartbeats_is_refused() -> None:
    from chaos.daemon.config import DaemonConfig

    from chaos.errors import ConfigError

    with pytest.raises(ConfigError, match="behind_grace_s"):
        DaemonConfig(node_id="a", listen=ADDR, heartbeat_interval_s=0.5, behind_grace_s=1.0)
    with pytest.raises(ConfigError, match="behind_grace_s"):
        DaemonConfig(node_id="a", listen=ADDR, behind_grace_s=float("nan"))
    assert DaemonConfig(node_id="a", listen=ADDR, behind_grace_s=0.0).behind_grace_s == 0.0


# ----------------------------------------------------------------- the scheduler role


def _role() -> tuple[Any, Recorder]:
    """A scheduler ``a`` with three training members a, b, c (a triangle)."""
    from chaos.daemon.config import DaemonConfig
    from chaos.daemon.scheduler.role import SchedulerRole

    from chaos.protocol import TrainerInfo
    from chaos.protocol.states import NodeState

    cfg = DaemonConfig(
        node_id="a", listen="tcp://127.0.0.1:1", heartbeat_interval_s=0.2, failure_timeout_s=1.0,
        straggler_grace_s=GRACE, behind_grace_s=GRACE,
    )  # fmt: skip
    ctx, host = recording_context(cfg)
    role = SchedulerRole(ctx, None, 0.0)
    for i, n in enumerate("bc"):
        role.monitor.add_node(n, f"tcp://127.0.0.1:{10 + i}", NodeState.ACTIVE, 0.0)
    for x, y in (("a", "b"), ("b", "c"), ("a", "c")):
        role.monitor.set_link(x, y, latency_s=0.001, bandwidth_bps=1e9)
    for i, n in enumerate(ABC):
        info = TrainerInfo(
            sender=n, node_id=n, data_address=f"tcp://127.0.0.1:{20 + i}",
            shard_address=f"tcp://127.0.0.1:{30 + i}", has_state=n == "a", tensor_sizes=[64],
        )  # fmt: skip
        role.trainers.on_info(info, None, 0.0)
        if n != "a":  # b, then c, pulled the state: training (one joiner enters at a time)
            role.trainers.on_event(TrainerReady(sender=n, node_id=n), None, 0.0)
    return role, host


def _step_failed(role: Any, now: float) -> None:
    """a's round waited 3 s for its neighbour b, and failed (answered under op id ``x``)."""
    failed = StepFailed(sender="a", node_id="a", detail="b", epoch=role.epoch, elapsed_s=3.0,
                        op_id="x")  # fmt: skip
    role.on_step_failed(failed, None, now)


def _progress(role: Any, now: float, **reports: tuple[int, bool, float, float]) -> None:
    for n, (step, in_step, phase_s, silent_s) in reports.items():
        msg = TrainerProgress(sender=n, node_id=n, step=step, in_step=in_step,
                              elapsed_s=phase_s, silent_s=silent_s)  # fmt: skip
        role.on_trainer_progress(msg, now)
        role.failures.heard(n, now)


def test_the_scheduler_evicts_the_straggler_and_the_others_go_on_without_it() -> None:
    from chaos.protocol.states import TrainerState

    role, host = _role()
    assert role.monitor.trainer_members((TrainerState.TRAINING,)) == list(ABC)
    epoch = role.epoch
    _progress(role, 10.0, a=(7, True, 1.0, 0.1), b=(7, True, 1.0, 0.1), c=(7, False, 1.0, 1.0))
    role.tick(10.0)
    assert host.named("straggler_evicted") == [] and role.epoch == epoch
    _progress(role, 11.5, a=(7, True, 2.5, 0.1), b=(7, True, 2.5, 0.1), c=(7, False, 2.5, 2.5))
    role.tick(11.5)
    [ev] = host.named("straggler_evicted")
    assert ev["peer"] == "c" and ev["waiting"] == ["a", "b"] and ev["at_step"] == 7
    assert role.monitor.trainer("c") == TrainerState.NONE and role.monitor.has("c")
    upd = host.updates[-1]
    assert upd.cause == "straggler_evicted" and upd.restart_allreduce
    assert upd.apply_at == "before_next_allreduce" and sorted(upd.sync.nodes) == ["a", "b"]
    # its daemon's next reports change nothing (it no longer trains); no second commit
    _progress(role, 12.0, c=(7, False, 3.0, 3.0))
    role.tick(12.0)
    assert len(host.named("straggler_evicted")) == 1 and role.epoch == epoch + 1


def test_the_scheduler_evicts_a_member_stuck_a_step_behind() -> None:
    from chaos.protocol.states import TrainerState

    role, host = _role()
    epoch = role.epoch
    _progress(role, 10.0, a=(8, True, 1.0, 0.1), b=(8, True, 1.0, 0.1), c=(7, True, 1.0, 0.1))
    role.tick(10.0)
    assert host.named("straggler_evicted") == [] and role.epoch == epoch
    _progress(role, 11.5, a=(8, True, 2.5, 0.1), b=(8, True, 2.5, 0.1), c=(7, True, 2.5, 0.1))
    role.tick(11.5)
    [ev] = host.named("straggler_evicted")
    assert ev["peer"] == "c" and ev["behind"] and ev["at_step"] == 8 and ev["step"] == 7
    assert role.monitor.trainer("c") == TrainerState.NONE and role.monitor.has("c")
    upd = host.updates[-1]
    assert upd.cause == "straggler_evicted" and upd.restart_allreduce
    assert sorted(upd.sync.nodes) == ["a", "b"]


def test_a_restart_superseded_at_once_is_carried_by_the_commits_that_keep_its_structure() -> None:
    """A soak stalled a minute: an eviction's restart was followed within a millisecond by a
    joiner's registration, the trainers in the old round read only that newest policy (no
    restart) and waited out their step timeout."""
    from chaos.protocol.states import TrainerState

    role, host = _role()
    _progress(role, 10.0, a=(8, True, 1.0, 0.1), b=(8, True, 1.0, 0.1), c=(7, True, 1.0, 0.1))
    _progress(role, 11.5, a=(8, True, 2.5, 0.1), b=(8, True, 2.5, 0.1), c=(7, True, 2.5, 0.1))
    role.tick(11.5)
    evicted = host.updates[-1]
    assert evicted.cause == "straggler_evicted" and evicted.restart_allreduce
    role.ledger.commit("trainer_catch_up", 11.6, apply_at="after_allreduce", restart=False)
    upd = host.updates[-1]
    assert upd.cause == "trainer_catch_up" and upd.restart_allreduce
    assert upd.sync.topology_epoch == evicted.sync.topology_epoch  # the same rerun, not a new one
    role.monitor.set_trainer("c", TrainerState.TRAINING, None, None)  # a new structure
    role.ledger.commit("trainer_scale_out", 12.0, apply_at="after_allreduce", restart=False)
    upd = host.updates[-1]
    assert upd.sync.topology_epoch > evicted.sync.topology_epoch and not upd.restart_allreduce


def test_a_failed_step_is_blamed_on_the_member_that_stopped() -> None:
    role, host = _role()
    _progress(role, 5.0, a=(3, True, 3.0, 0.1), b=(3, True, 3.0, 0.1), c=(3, False, 3.1, 3.1))
    # a's round waited 3 s for its neighbour b, which waited for c
    _step_failed(role, 5.0)
    [ev] = host.named("allreduce_failed")
    assert ev["peer"] == "c" and ev["neighbour"] == "b" and ev["reporter"] == "a"
    answer = host.answers[-1]
    assert answer.ok and answer.op_id == "x" and answer.detail == "c"


def _steps(w: StragglerWatch, nodes: tuple[str, ...], period_s: float, upto: int) -> float:
    """Every member in ``nodes`` reports steps 1..``upto``, one every ``period_s`` (heard at
    each boundary); returns the time of the last."""
    now = 0.0
    for step in range(1, upto + 1):
        now = step * period_s
        for n in nodes:
            w.report(n, step, True, 0.0, 0.0, now)
    return now


def test_the_grace_scales_with_a_step_that_is_slow_for_everyone() -> None:
    w = _watch()
    assert w.grace_at(ABC) == GRACE  # nothing measured yet
    now = _steps(w, ABC, 6.0, 4)  # a slow link: 6 s a step for every member
    assert w.step_period(ABC) == pytest.approx(6.0)
    assert w.grace_at(ABC) == pytest.approx(12.0)
    # a and b wait 5 s in the round at step 5 and are heard; c, busy in it, was not heard
    # for 5 s (past the 2 s grace, within two of its slow steps): no straggler
    w.report("a", 5, True, 5.0, 0.1, now + 5.0)
    w.report("b", 5, True, 5.0, 0.1, now + 5.0)
    w.report("c", 5, True, 5.0, 5.0, now + 5.0)
    assert w.find(ABC, now + 5.0) == []
    # silent for longer than two step periods: it is not progressing
    w.report("a", 5, True, 13.0, 0.1, now + 13.0)
    w.report("b", 5, True, 13.0, 0.1, now + 13.0)
    w.report("c", 5, True, 13.0, 13.0, now + 13.0)
    assert [s.node for s in w.find(ABC, now + 13.0)] == ["c"]


def test_a_stopped_member_of_a_fast_cluster_keeps_the_plain_grace() -> None:
    w = _watch()
    now = _steps(w, ABC, 0.5, 6)
    assert w.grace_at(ABC) == GRACE  # two 0.5 s steps are shorter than the grace
    w.report("a", 7, True, 2.5, 0.1, now + 2.5)
    w.report("b", 7, True, 2.5, 0.1, now + 2.5)
    w.report("c", 6, False, 2.5, 2.5, now + 2.5)  # stopped (SIGSTOP) while computing step 7
    assert [s.node for s in w.find(ABC, now + 2.5)] == ["c"]


def test_one_long_step_does_not_stretch_the_period_and_forget_drops_it() -> None:
    w = _watch()
    now = _steps(w, ABC, 0.5, 3)
    for n in ABC:  # one 30 s step (a joiner's barrier pull), then fast steps again
        w.report(n, 4, True, 0.0, 0.0, now + 30.0)
    assert w.step_period(ABC) == pytest.approx(0.5)
    assert w.grace_at(ABC) == GRACE
    for n in ABC:
        w.forget(n)
    assert w.step_period(ABC) is None
    assert StragglerWatch(0.0, FRESH).grace_at(ABC) == 0.0
