"""The catch-up snapshot's step, sized from the donors' step clock, the commit's way to them and
the plan's transfer time (a pure function)."""

from __future__ import annotations

import math

import pytest
from chaos.daemon.scheduler.snapshot_lead import SPARE_STEP_SHARE, snapshot_step


def test_commit_in_time_plans_the_next_boundary_and_a_spare_step_for_a_long_transfer() -> None:
    # a 0.1 s step against a 2 s transfer: the spare step costs 5 % of it
    assert snapshot_step(40, 0.1, 0.05, 0.01, 2.0) == 42


def test_no_spare_step_when_the_step_is_long_against_the_transfer() -> None:
    assert snapshot_step(40, 1.0, 0.5, 0.01, 2.0) == 41
    edge = 0.1 / SPARE_STEP_SHARE  # the spare step's cost is exactly the share: it is taken
    assert snapshot_step(40, 0.1, 0.05, 0.0, edge) == 42
    assert snapshot_step(40, 0.1, 0.05, 0.0, math.nextafter(edge, 0.0)) == 41


def test_a_commit_that_outlasts_the_current_step_moves_the_step_on() -> None:
    # it reaches the donors 0.25 s after the boundary 0.05 s from now: 3 more boundaries
    assert snapshot_step(40, 0.1, 0.05, 0.3, 0.0) == 44
    # exactly at a boundary: that boundary is not planned (the donor may see it late)
    assert snapshot_step(40, 0.1, 0.0, 0.0, 0.0) == 41


def test_the_lead_never_falls_behind_the_boundary_that_ends_the_current_step() -> None:
    for period in (0.01, 0.1, 1.0, 10.0):
        for left in (0.0, period / 2, period):
            for reach in (0.0, 0.05, 3.0):
                for transfer in (0.0, 1.0, 100.0):
                    at = snapshot_step(7, period, left, reach, transfer)
                    assert at >= 8
                    # the planned boundary comes after the commit's arrival
                    assert left + (at - 8) * period >= reach - 1e-9


def test_the_lead_is_bounded_by_the_commits_way_and_one_spare_step() -> None:
    # a fixed lead in seconds is gone: a fast step waits no more than the commit's way
    at = snapshot_step(100, 0.02, 0.01, 0.0, 5.0)
    assert at - 100 == 2


@pytest.mark.parametrize(
    "args",
    [
        (0, 0.0, 0.0, 0.0, 1.0),
        (0, -1.0, 0.0, 0.0, 1.0),
        (0, math.inf, 0.0, 0.0, 1.0),
        (0, math.nan, 0.0, 0.0, 1.0),
        (-1, 0.1, 0.0, 0.0, 1.0),
        (0, 0.1, -0.1, 0.0, 1.0),
        (0, 0.1, 0.0, math.nan, 1.0),
        (0, 0.1, 0.0, 0.0, -1.0),
    ],
)
def test_bad_measurements_are_refused(args: tuple[int, float, float, float, float]) -> None:
    with pytest.raises(ValueError):
        snapshot_step(*args)
