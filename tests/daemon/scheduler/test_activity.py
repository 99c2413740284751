"""What the scheduler's status shows of the training members and of the joins in progress
(pure: a monitor fed progress reports, no sockets)."""

from __future__ import annotations

import pytest
from chaos.daemon.scheduler.activity import join_activity, member_activity
from chaos.daemon.scheduler.monitor import ClusterMonitor

from chaos.protocol import NodeState, PullStatus, TrainerState


def _monitor() -> ClusterMonitor:
    m = ClusterMonitor()
    for i, node in enumerate(("a", "b", "j")):
        m.add_node(node, f"tcp://127.0.0.1:{9000 + i}", NodeState.ACTIVE, 0.0)
    m.set_trainer("a", TrainerState.TRAINING, "tcp://127.0.0.1:1", "tcp://127.0.0.1:2")
    m.set_trainer("b", TrainerState.TRAINING, "tcp://127.0.0.1:3", "tcp://127.0.0.1:4")
    m.set_trainer("j", TrainerState.SYNCING, None, None)
    return m


def test_a_members_step_and_rate_come_from_its_step_boundaries() -> None:
    m = _monitor()
    for k in range(5):  # a steps every 0.1 s; b has reported once
        m.observe_progress("a", 10 + k, False, 0.0, 100.0 + 0.1 * k)
    m.observe_progress("b", 7, False, 0.0, 100.0)
    got = {x.id: x for x in member_activity(m, 100.65)}
    assert set(got) == {"a", "b"}  # j is not training
    assert got["a"].steps_per_s == pytest.approx(10.0, rel=0.05)
    assert got["a"].step == 16  # 14 at 100.4, then two more periods by 100.65
    assert got["a"].heard_s == pytest.approx(0.25)
    assert got["b"].steps_per_s == 0.0 and got["b"].step == 7  # no period measured yet


def test_a_join_shows_its_last_pull_report_and_its_donors() -> None:
    m = _monitor()
    assert [(x.id, x.pull) for x in join_activity(m, 5.0)] == [("j", None)]
    pull = PullStatus(pulled_bytes=300, total_bytes=1000, donors={"a": 200, "b": 100})
    m.observe_pull_progress("j", pull, 4.0)
    (j,) = join_activity(m, 5.0)
    assert j.pull == pull and j.donors == ["a", "b"] and j.heard_s == pytest.approx(1.0)
    m.set_trainer("j", TrainerState.TRAINING, "tcp://127.0.0.1:5", "tcp://127.0.0.1:6")
    assert join_activity(m, 6.0) == []  # entered: no longer a join
    m.remove_node("j")
    assert "j" not in m.pulls
