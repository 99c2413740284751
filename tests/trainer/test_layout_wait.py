"""A trainer whose state's layout changed on its first step (Adam creates its state then) tells
the scheduler; a paused daemon (a minority side of a partition) holds that up, and the trainer
waits as a step does, up to ``stall_timeout_s`` (a campaign trainer crashed on a 15 s limit).

The session stands in for the daemon: what is tested is the wait around the registration."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from chaos.daemon.client import RequestRefused

import chaos.trainer.trainer as trainer_module
from chaos.protocol import TrainerRegister
from chaos.trainer.trainer import Trainer, TrainingStalled


def _trainer(refusals: list[Exception], stall_timeout_s: float | None) -> Any:
    calls: list[TrainerRegister] = []
    events: list[tuple[str, dict[str, Any]]] = []

    def register(reg: TrainerRegister, **_kwargs: Any) -> None:
        calls.append(reg)
        if len(calls) <= len(refusals):
            raise refusals[len(calls) - 1]

    return SimpleNamespace(
        _donor=SimpleNamespace(layout_change=lambda step, epoch: [4, 4, 1]),
        _plane=SimpleNamespace(address="tcp://a:1", shard_address="tcp://a:2"),
        _session=SimpleNamespace(register=register, daemon_paused=True),
        config=SimpleNamespace(stall_timeout_s=stall_timeout_s),
        _event=lambda name, **kw: events.append((name, kw)),
        node_id="n1", _epoch=3, _step=1, calls=calls, events=events,
    )  # fmt: skip


def _paused() -> RequestRefused:
    return RequestRefused("paused", "no scheduler with a majority")


def test_the_new_layout_waits_out_a_paused_daemon() -> None:
    t = _trainer([_paused() for _ in range(6)], stall_timeout_s=None)
    Trainer._maybe_reregister(t)
    assert len(t.calls) == 7 and list(t.calls[-1].tensor_sizes) == [4, 4, 1]
    waits = [kw for name, kw in t.events if name == "waiting"]
    assert len(waits) == 6 and all(w["paused"] for w in waits)


def test_the_new_layout_gives_up_at_the_users_stall_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = iter(float(x) for x in range(0, 1000, 15))  # every registration round takes 15 s
    monkeypatch.setattr(trainer_module.time, "monotonic", lambda: next(clock))
    t = _trainer([_paused() for _ in range(100)], stall_timeout_s=40.0)
    with pytest.raises(TrainingStalled, match="layout"):
        Trainer._maybe_reregister(t)
    assert len(t.calls) == 3


def test_a_refusal_for_good_is_raised_at_once() -> None:
    t = _trainer([RequestRefused("bad_request", "malformed sizes")], stall_timeout_s=None)
    with pytest.raises(RequestRefused, match="malformed"):
        Trainer._maybe_reregister(t)
    assert len(t.calls) == 1
