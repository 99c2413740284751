"""A link the allreduce found failing becomes a disconnect-link once checked (the scheduler
role in process, its daemon stood in for; the link check's answer is the agent's LinkReport)."""

from __future__ import annotations

from typing import Any

from chaos.protocol import ConnectCommand, LinkReport
from tests.daemon.scheduler.test_stragglers import _progress, _role, _step_failed


class _Sends:
    """Records what the role sends (the probe orders)."""

    def __init__(self, host: Any) -> None:
        self.sent: list[tuple[str, Any]] = []
        host.send = lambda peer, msg: self.sent.append((peer, msg)) or True


def _fail(role: Any, now: float) -> None:
    # every trainer progressed just now: no straggler explains the failure
    _progress(role, now, a=(3, True, 3.0, 0.1), b=(3, True, 3.0, 0.1), c=(3, True, 3.0, 0.1))
    _step_failed(role, now)


def _order(sends: _Sends) -> ConnectCommand:
    [(peer, cmd)] = [(p, m) for p, m in sends.sent if isinstance(m, ConnectCommand)]
    assert peer == "a" and cmd.peer == "b" and cmd.op_id.startswith("verify-")
    return cmd


def test_a_round_failed_on_a_dead_link_disconnects_it() -> None:
    role, host = _role()
    sends = _Sends(host)
    epoch = role.epoch
    _fail(role, 5.0)
    cmd = _order(sends)
    report = LinkReport(sender="a", epoch=role.epoch, term=1, peer="b", up=False, op_id=cmd.op_id)
    role.on_link_report(report, 5.5)
    assert role.monitor.link("a", "b")["up"] is False
    assert [f["by"] for f in host.named("link_down")] == ["allreduce"]
    upd = host.updates[-1]
    assert upd.cause == "disconnect_link" and upd.restart_allreduce and role.epoch > epoch


def test_a_link_that_answers_stays_and_one_check_runs_at_a_time() -> None:
    role, host = _role()
    sends = _Sends(host)
    _fail(role, 5.0)
    _fail(role, 5.1)  # the other end's report of the same round: no second check
    cmd = _order(sends)
    epoch = role.epoch
    report = LinkReport(sender="a", epoch=role.epoch, term=1, peer="b", up=True, latency_s=1e-4,
                        op_id=cmd.op_id)  # fmt: skip
    role.on_link_report(report, 5.5)
    assert role.monitor.link("a", "b")["up"] is True
    assert host.named("link_verified")[0]["up"] is True and role.epoch == epoch


def test_a_check_without_any_answer_counts_as_down() -> None:
    role, host = _role()
    sends = _Sends(host)
    _fail(role, 5.0)
    _order(sends)
    role.links.tick(5.0 + role.cfg.link_failure_timeout_s + 0.1)
    assert role.monitor.link("a", "b")["up"] is False
    assert host.named("link_down")[0]["by"] == "allreduce"
