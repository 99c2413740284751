"""A trainer that joins again (evicted, or its entry pull failed) keeps trying while its
donors come and go, and gives up only at the user's own limit (``stall_timeout_s``); a first
join does the same within ``join_timeout_s``.

The registration and pull are stood in for: what is tested is the retry policy around them
(the real joins again run in tests/trainer/test_catch_up.py and test_straggler.py).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from chaos.daemon.client import RequestRefused

import chaos.trainer.join_retry as retry_module
from chaos.errors import ReplicationError
from chaos.protocol import TrainerRegister
from chaos.trainer.join_retry import UnreachableWatch
from chaos.trainer.lifecycle import Lifecycle, TrainerPhase
from chaos.trainer.trainer import Trainer


def _joiner(failures: int, stall_timeout_s: float | None,
            error: Exception | None = None) -> Any:  # fmt: skip
    calls: list[tuple[Any, Any]] = []
    events: list[tuple[str, dict[str, Any]]] = []

    def register_and_sync(*args: Any, **kwargs: Any) -> None:
        calls.append((args, kwargs))
        if len(calls) <= failures:
            raise error or ReplicationError(
                "no donor left to pull the state from: every donor is gone")

    joiner = SimpleNamespace(
        _donor=SimpleNamespace(retire=lambda: None),
        config=SimpleNamespace(stall_timeout_s=stall_timeout_s),
        _register_and_sync=register_and_sync,
        _event=lambda name, **kw: events.append((name, kw)),
        _unreachable=UnreachableWatch(),
        _life=Lifecycle("n1", start=TrainerPhase.LIVE),  # a member evicted while training
        node_id="n1", calls=calls, events=events,
    )  # fmt: skip
    joiner._join_until = lambda *a, **kw: Trainer._join_until(joiner, *a, **kw)
    return joiner


def test_a_join_again_whose_donors_keep_going_is_retried_until_it_succeeds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pauses: list[float] = []
    monkeypatch.setattr(retry_module.time, "sleep", pauses.append)
    joiner = _joiner(failures=7, stall_timeout_s=None)  # more than the old limit of 3
    Trainer._join_again(joiner)
    assert joiner._life.phase is TrainerPhase.REJOINING  # the stand-in registers, not moves
    assert len(joiner.calls) == 8
    assert [kw["attempt"] for name, kw in joiner.events] == list(range(1, 8))
    assert pauses == [1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0]  # paced, capped


def test_a_join_again_gives_up_at_the_users_stall_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [100.0]
    monkeypatch.setattr(retry_module.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(retry_module.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    joiner = _joiner(failures=1000, stall_timeout_s=10.0)
    with pytest.raises(ReplicationError, match="no donor left"):
        Trainer._join_again(joiner)
    assert len(joiner.calls) == 4  # pauses 1 + 2 + 3 = 6 s; a fourth would end past 10 s


def test_a_join_again_refused_for_want_of_a_state_source_waits_for_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scheduler just elected may not know the state's layout yet: the registration is
    refused ``no_state_source`` for a while (a campaign's trainers crashed on it)."""
    monkeypatch.setattr(retry_module.time, "sleep", lambda s: None)
    refusal = RequestRefused("no_state_source", "no trainer registered the state layout")
    joiner = _joiner(failures=3, stall_timeout_s=None, error=refusal)
    Trainer._join_again(joiner)
    assert len(joiner.calls) == 4


def test_a_join_again_refused_for_good_raises_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry_module.time, "sleep", lambda s: None)
    refusal = RequestRefused("state_conflict", "a and b already train")
    joiner = _joiner(failures=3, stall_timeout_s=None, error=refusal)
    with pytest.raises(RequestRefused, match="state_conflict"):
        Trainer._join_again(joiner)
    assert len(joiner.calls) == 1


def test_a_first_join_whose_donors_went_is_retried_within_the_join_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A campaign's joiner exited when every donor of its plan was gone by the time it pulled;
    the cluster had others to pull from a moment later."""
    clock = [100.0]
    monkeypatch.setattr(retry_module.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(retry_module.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    joiner = _joiner(failures=2, stall_timeout_s=None)
    Trainer._join_until(joiner, 100.0 + 60.0, 100.0)
    assert len(joiner.calls) == 3
    # every attempt keeps the trainer's start time (its ready time counts from there) and is a
    # first join (a restored state is not thrown away)
    assert all(args == (True, 100.0) and kw == {"rejoin": False} for args, kw in joiner.calls)
    with pytest.raises(ReplicationError):  # past join_timeout_s: the error, as before
        Trainer._join_until(_joiner(failures=1000, stall_timeout_s=None), 100.0 + 60.0, 100.0)


def test_a_join_again_refused_paused_past_the_sessions_retries_waits_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A minority side's daemon refuses ``paused`` for as long as the partition lasts; the
    session's own retries end after 15 s, the join does not."""
    monkeypatch.setattr(retry_module.time, "sleep", lambda s: None)
    joiner = _joiner(failures=5, stall_timeout_s=None,
                     error=RequestRefused("paused", "no scheduler with a majority"))  # fmt: skip
    Trainer._join_again(joiner)
    assert len(joiner.calls) == 6


def test_a_new_layout_refused_as_a_second_state_joins_again() -> None:
    """A member whose new layout (step 128's wider runtime record) waited out a partition on
    the minority side was evicted meanwhile; after the heal the scheduler refuses the layout
    ``state_conflict`` (the others train, it does not any more). It joins again and pulls the
    current state instead of exiting (a CI run's minority trainer exited on it)."""
    refusals = [RequestRefused("paused", "no scheduler with a majority"),
                RequestRefused("state_conflict", "a,b already train")]  # fmt: skip
    registered: list[TrainerRegister] = []
    joined: list[bool] = []

    def register(reg: TrainerRegister, **_kwargs: Any) -> None:
        registered.append(reg)
        raise refusals.pop(0)

    events: list[tuple[str, dict[str, Any]]] = []
    trainer = SimpleNamespace(
        _donor=SimpleNamespace(layout_change=lambda step, epoch: [4, 8]),
        _plane=SimpleNamespace(address="tcp://10.0.0.3:1", shard_address="tcp://10.0.0.3:2"),
        config=SimpleNamespace(stall_timeout_s=None),
        _session=SimpleNamespace(register=register, daemon_paused=True),
        _event=lambda name, **kw: events.append((name, kw)),
        _join_again=lambda: joined.append(True),
        node_id="c", _step=128, _epoch=9,
    )  # fmt: skip
    trainer._layout_refused = lambda exc: Trainer._layout_refused(trainer, exc)
    Trainer._maybe_reregister(trainer)
    assert len(registered) == 2 and all(reg.has_state for reg in registered)
    assert joined == [True]
    assert [name for name, _ in events] == ["waiting", "evicted"]


def test_a_new_layout_refused_for_another_reason_still_raises() -> None:
    def register(*args: Any, **kwargs: Any) -> None:
        raise RequestRefused("bad_request", "c is not an active member")

    trainer = SimpleNamespace(
        _donor=SimpleNamespace(layout_change=lambda step, epoch: [4, 8]),
        _plane=SimpleNamespace(address="tcp://10.0.0.3:1", shard_address="tcp://10.0.0.3:2"),
        config=SimpleNamespace(stall_timeout_s=None),
        _session=SimpleNamespace(register=register, daemon_paused=False),
        _event=lambda name, **kw: None, _join_again=lambda: None,
        node_id="c", _step=128, _epoch=9,
    )  # fmt: skip
    with pytest.raises(RequestRefused, match="bad_request"):
        Trainer._maybe_reregister(trainer)
