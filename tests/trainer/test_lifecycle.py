"""The Trainer's lifecycle table (pure): the moves it allows, the ones it refuses, the listener."""

from __future__ import annotations

import pytest

from chaos.protocol.states import PHASE_TRANSITIONS, TrainerPhase
from chaos.trainer.lifecycle import IllegalTransition, Lifecycle

P = TrainerPhase


def test_every_phase_has_a_row_and_only_closed_is_final() -> None:
    assert set(PHASE_TRANSITIONS) == set(P)
    finals = [p for p, nxt in PHASE_TRANSITIONS.items() if not nxt]
    assert finals == [P.CLOSED]


def test_every_phase_but_closed_can_leave_and_every_phase_is_reachable() -> None:
    for p in P:
        if p not in (P.LEAVING, P.CLOSED):
            assert P.LEAVING in PHASE_TRANSITIONS[p], p
    reached = {P.JOINING}
    frontier = [P.JOINING]
    while frontier:
        for nxt in PHASE_TRANSITIONS[frontier.pop()]:
            if nxt not in reached:
                reached.add(nxt)
                frontier.append(nxt)
    assert reached == set(P)


@pytest.mark.parametrize(
    "path",
    [
        # a barrier join, a failed round and its rerun, a leave
        [P.PULLING, P.LIVE, P.STALLED, P.LIVE, P.LEAVING, P.CLOSED],
        # a catch-up join
        [P.PULLING, P.CATCHING_UP, P.ENTERING, P.LIVE],
        # a catch-up entry that failed, then a join again
        [P.PULLING, P.CATCHING_UP, P.ENTERING, P.REJOINING, P.JOINING, P.PULLING, P.LIVE],
        # a minority side of a partition: stalled, paused, evicted at the heal, joins again
        [P.LIVE, P.STALLED, P.PAUSED, P.REJOINING, P.JOINING, P.PULLING, P.LIVE],
        # the first member: nothing to pull
        [P.LIVE, P.LEAVING, P.CLOSED],
    ],
)
def test_the_paths_a_trainer_takes_are_allowed(path: list[TrainerPhase]) -> None:
    seen: list[tuple[TrainerPhase, TrainerPhase, str]] = []
    life = Lifecycle("n1", lambda old, new, why: seen.append((old, new, why)))
    for p in path:
        life.move(p, why=f"to {p.value}")
    assert life.phase is path[-1]
    assert [new for _, new, _ in seen] == path
    assert seen[0][0] is P.JOINING


@pytest.mark.parametrize(
    ("start", "to"),
    [
        (P.JOINING, P.ENTERING),  # entering needs a snapshot and a replay first
        (P.CATCHING_UP, P.LIVE),  # a catching-up joiner enters first
        (P.LIVE, P.CATCHING_UP),
        (P.LIVE, P.PULLING),  # pulling again goes through rejoining
        (P.CLOSED, P.LEAVING),
        (P.CLOSED, P.LIVE),
        (P.LEAVING, P.LIVE),
    ],
)
def test_a_move_the_table_does_not_list_is_refused(start: TrainerPhase, to: TrainerPhase) -> None:
    seen: list[object] = []
    life = Lifecycle("n1", lambda *a: seen.append(a), start=start)
    with pytest.raises(IllegalTransition, match=f"from {start.value} to {to.value}"):
        life.move(to, why="test")
    assert life.phase is start and not seen


def test_staying_is_no_move() -> None:
    seen: list[object] = []
    life = Lifecycle("n1", lambda *a: seen.append(a), start=P.STALLED)
    life.move(P.STALLED)
    assert life.phase is P.STALLED and not seen
