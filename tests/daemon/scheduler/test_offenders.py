"""The repeat-offender rule (daemon/scheduler/offenders.py) and its wiring in the scheduler role.

Pure rules first (no sockets: steps and reports are given), then the scheduler role in process,
with a host that records what it would send: the members' ``NonfiniteStep`` reports in,
``offender_evicted`` and the commit out.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from chaos.daemon.config import DaemonConfig
from chaos.daemon.scheduler.offenders import OffenderWatch

from chaos.errors import ConfigError, ProtocolError
from chaos.protocol import NonfiniteStep, TrainerReady, decode, encode
from tests.daemon.recorder import Recorder, recording_context

ABC = ("a", "b", "c")


def _all_report(
    w: OffenderWatch, step: int, devices: tuple[str, ...], members: tuple[str, ...] = ABC
) -> None:
    for m in members:
        w.report(m, step, devices, members)


def test_a_device_named_by_a_majority_in_limit_steps_is_due() -> None:
    w = OffenderWatch(limit=3, window=100)
    for step in (10, 11):
        _all_report(w, step, ("b",))
        assert w.due(ABC) == []
    assert w.report("a", 12, ["b"], ABC) == []  # one report of three: not yet an offence
    assert w.report("c", 12, ["b"], ABC) == ["b"]  # the second: a majority
    assert w.report("b", 12, ["b"], ABC) == []  # the third counts nothing more
    [o] = w.due(ABC)
    assert o.node == "b" and o.steps == (10, 11, 12) and o.count == 3
    assert (o.limit, o.window) == (3, 100)


def test_one_member_alone_never_makes_an_offence() -> None:
    w = OffenderWatch(limit=1, window=100)
    for step in range(20):  # a forged, or confused, member names c at every step
        assert w.report("a", step, ["c"], ABC) == []
        w.report("a", step, ["c"], ABC)  # repeating its report changes nothing
    assert w.due(ABC) == [] and w.offences == {}


def test_offences_out_of_the_window_do_not_count() -> None:
    w = OffenderWatch(limit=3, window=10)
    _all_report(w, 0, ("b",))
    _all_report(w, 5, ("b",))
    _all_report(w, 12, ("b",))  # step 0 is out of the window (12 - 10)
    assert w.due(ABC) == [] and w.in_window("b") == (5, 12)
    _all_report(w, 14, ("b",))
    assert [o.steps for o in w.due(ABC)] == [(5, 12, 14)]
    assert w.report("a", 2, ["b"], ABC) == []  # a late report of a step out of the window


def test_every_device_named_is_counted_and_an_overflow_names_none() -> None:
    w = OffenderWatch(limit=2, window=100)
    _all_report(w, 1, ("b", "c"))
    _all_report(w, 2, ())  # the sum overflowed: no device to blame
    _all_report(w, 3, ("c",))
    assert [(o.node, o.steps) for o in w.due(ABC)] == [("c", (1, 3))]
    assert w.in_window("b") == (1,)


def test_reporters_and_devices_outside_the_training_members_are_ignored() -> None:
    w = OffenderWatch(limit=1, window=100)
    assert w.report("d", 1, ["b"], ABC) == []  # d does not train (a catching-up joiner)
    w.report("a", 1, ["d"], ABC)
    w.report("b", 1, ["d"], ABC)
    assert w.due(ABC) == [] and w.offences == {}


def test_the_majority_is_of_the_members_training_now() -> None:
    w = OffenderWatch(limit=1, window=100)
    ab = ("a", "b")
    assert w.report("a", 4, ["b"], ab) == []  # two train: both must name it
    assert w.report("b", 4, ["b"], ab) == ["b"]
    [o] = w.due(ab)
    assert o.node == "b"


def test_a_lone_trainer_is_never_due_and_a_limit_of_zero_is_off() -> None:
    w = OffenderWatch(limit=1, window=100)
    w.report("a", 1, ["a"], ("a",))
    assert w.in_window("a") == (1,) and w.due(("a",)) == []
    off = OffenderWatch(limit=0, window=100)
    for step in range(5):
        _all_report(off, step, ("b",))
    assert off.due(ABC) == [] and off.in_window("b") == (0, 1, 2, 3, 4)


def test_forget_starts_a_device_afresh() -> None:
    w = OffenderWatch(limit=2, window=100)
    _all_report(w, 1, ("b",))
    w.report("a", 2, ["b"], ABC)  # half a report of step 2 when b is evicted
    w.forget("b")
    assert w.in_window("b") == ()
    w.report("c", 2, ["b"], ABC)  # its remaining reports restart the count
    assert w.due(ABC) == [] and w.in_window("b") == ()
    w.report("a", 2, ["b"], ABC)
    assert w.in_window("b") == (2,)


def test_bad_limits_are_refused() -> None:
    with pytest.raises(ValueError):
        OffenderWatch(limit=-1, window=10)
    with pytest.raises(ValueError):
        OffenderWatch(limit=1, window=0)
    for fields in ({"offender_limit": -1}, {"offender_window_steps": 0},
                   {"offender_limit": 5, "offender_window_steps": 4},
                   {"offender_limit": True}):  # fmt: skip
        with pytest.raises(ConfigError):
            DaemonConfig(node_id="a", listen="tcp://127.0.0.1:7700", **fields)


def test_the_report_is_a_typed_message_with_bounded_devices() -> None:
    msg = NonfiniteStep(step=7, devices=["b", "c"])
    back = decode(encode(msg))
    assert isinstance(back, NonfiniteStep) and back.devices == ["b", "c"] and back.step == 7
    raw = msgspec.msgpack.decode(encode(msg))
    raw["devices"] = ["x"] * 1000
    with pytest.raises(ProtocolError, match="malformed|devices"):
        decode(msgspec.msgpack.encode(raw))


# -- the scheduler role --------------------------------------------------------------------


def _role(**cfg_fields: Any) -> tuple[Any, Recorder]:
    """A scheduler ``a`` with three training members a, b, c (a triangle)."""
    from chaos.daemon.scheduler.role import SchedulerRole

    from chaos.protocol import TrainerInfo
    from chaos.protocol.states import NodeState

    cfg = DaemonConfig(node_id="a", listen="tcp://127.0.0.1:1", heartbeat_interval_s=0.2,
                       failure_timeout_s=1.0, **cfg_fields)  # fmt: skip
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
        if n != "a":
            role.trainers.on_event(TrainerReady(sender=n, node_id=n), None, 0.0)
    return role, host


def _skipped(role: Any, step: int, *devices: str, reporters: tuple[str, ...] = ABC) -> None:
    for n in reporters:
        msg = NonfiniteStep(sender=n, node_id=n, step=step, devices=list(devices))
        role.on_nonfinite(msg, 1.0)


def test_the_scheduler_evicts_a_repeat_offender_and_the_others_go_on() -> None:
    from chaos.protocol.states import TrainerState

    role, host = _role(offender_limit=3, offender_window_steps=50)
    epoch = role.epoch
    _skipped(role, 20, "c")
    _skipped(role, 21, "c")
    assert host.named("offender_evicted") == [] and role.epoch == epoch
    _skipped(role, 22, "c", reporters=("a", "b"))  # a majority: c's third offence
    [ev] = host.named("offender_evicted")
    assert ev["peer"] == "c" and ev["offences"] == 3 and ev["steps"] == [20, 21, 22]
    assert ev["limit"] == 3 and ev["window_steps"] == 50
    assert role.monitor.trainer("c") == TrainerState.NONE and role.monitor.has("c")
    upd = host.updates[-1]
    assert upd.cause == "offender_evicted" and upd.restart_allreduce
    assert upd.apply_at == "before_next_allreduce" and sorted(upd.sync.nodes) == ["a", "b"]
    # the late report of step 22 (c's own) and more steps change nothing: c no longer trains
    _skipped(role, 22, "c", reporters=("c",))
    _skipped(role, 23, "c", reporters=("a", "b"))
    assert len(host.named("offender_evicted")) == 1 and role.epoch == epoch + 1


def test_reports_that_are_not_a_majority_evict_nobody() -> None:
    role, host = _role(offender_limit=2)
    epoch = role.epoch
    for step in range(10):  # b alone blames a at every step
        _skipped(role, step, "a", reporters=("b",))
    assert host.named("offender_evicted") == [] and role.epoch == epoch


def test_the_rule_off_evicts_nobody() -> None:
    role, host = _role(offender_limit=0)
    for step in range(10):
        _skipped(role, step, "b")
    assert host.named("offender_evicted") == []
