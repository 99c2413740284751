"""The step log of a catch-up join: a donor's bounded log, served by a real shard server and
fetched over a real socket (:mod:`chaos.replication.steplog`)."""

from __future__ import annotations

import pytest
import torch

from chaos.errors import ReplicationError
from chaos.replication.server import ShardServer
from chaos.replication.steplog import StepLog, decode_hypers, encode_hypers, fetch_steps


def _opt(lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=lr, momentum=0.9)


def test_logged_steps_come_back_in_order_with_their_hyperparameters() -> None:
    opt = _opt()
    log = StepLog("j", start=5, max_bytes=1 << 20)
    for step in range(5, 9):
        opt.param_groups[0]["lr"] = 0.1 * step
        assert log.append(step, torch.full((7,), float(step)), encode_hypers(opt))
    with ShardServer() as server:
        server.set_step_log(log)
        head, steps = fetch_steps(server.address, 6, torch.zeros(7), 5.0, max_entries=2)
        assert (head.start, head.head, head.closed_at, head.stopped) == (5, 9, None, False)
        assert [s.step for s in steps] == [6, 7]
        assert torch.equal(steps[1].grads, torch.full((7,), 7.0))
        other = _opt(lr=1.0)
        decode_hypers(steps[1].hypers, other)
        assert other.param_groups[0]["lr"] == pytest.approx(0.7)
        log.close(9)
        head, steps = fetch_steps(server.address, 9, torch.zeros(7), 5.0)
        assert head.closed_at == 9 and steps == []


def test_a_full_log_stops_and_says_so() -> None:
    log = StepLog("j", start=0, max_bytes=8 * 4)
    opt = _opt()
    assert log.append(0, torch.zeros(7), encode_hypers(opt))  # 28 bytes
    assert not log.append(1, torch.zeros(7), encode_hypers(opt))  # 56 > 32
    assert "exceed" in log.stopped and log.head == 1
    with ShardServer() as server:
        server.set_step_log(log)
        head, steps = fetch_steps(server.address, 0, torch.zeros(7), 5.0)
        assert head.stopped and [s.step for s in steps] == [0]


def test_a_skipped_step_stops_the_log() -> None:
    log = StepLog("j", start=3, max_bytes=1 << 20)
    opt = _opt()
    assert log.append(3, torch.zeros(2), encode_hypers(opt))
    assert not log.append(5, torch.zeros(2), encode_hypers(opt))
    assert "not the next" in log.stopped


def test_requests_out_of_the_log_or_of_another_size_are_refused() -> None:
    log = StepLog("j", start=10, max_bytes=1 << 20)
    log.append(10, torch.zeros(4), encode_hypers(_opt()))
    with ShardServer() as server:
        with pytest.raises(ReplicationError, match="not_published"):
            fetch_steps(server.address, 10, torch.zeros(4), 5.0)  # no log served
        server.set_step_log(log)
        with pytest.raises(ReplicationError, match="out_of_range"):
            fetch_steps(server.address, 9, torch.zeros(4), 5.0)  # before the snapshot
        with pytest.raises(ReplicationError, match="out_of_range"):
            fetch_steps(server.address, 12, torch.zeros(4), 5.0)  # past the head
        with pytest.raises(ReplicationError, match="expected step 10 with 20"):
            fetch_steps(server.address, 10, torch.zeros(5), 5.0)  # another model's buffer


def test_logged_hyperparameters_of_another_optimizer_layout_are_refused() -> None:
    two_groups = torch.optim.SGD(
        [{"params": [torch.zeros(1, requires_grad=True)]},
         {"params": [torch.zeros(1, requires_grad=True)]}], lr=0.1,
    )  # fmt: skip
    with pytest.raises(ReplicationError, match="another optimizer layout"):
        decode_hypers(encode_hypers(two_groups), _opt())
    with pytest.raises(ReplicationError, match="malformed"):
        decode_hypers(b"\xc1", _opt())


def test_a_frozen_snapshot_no_longer_reads_the_live_tensors() -> None:
    from chaos.replication.state import TrainingState, state_digest

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainingState.capture(model, opt, step=3, epoch=0)
    state.freeze()
    before = state_digest(state)
    with torch.no_grad():
        model.weight.add_(1.0)  # the donor trains on
    assert state_digest(state) == before
    live = TrainingState.capture(model, opt, step=3, epoch=0)
    assert state_digest(live) != before
