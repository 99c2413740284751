"""A catching-up joiner's replay of the steps it missed (``TrainerConfig.join_mode="catch-up"``).

The joiner pulled its donors' snapshot of step ``s0`` while the members trained on. Each donor
logs every step since ``s0`` (:class:`~chaos.replication.steplog.StepLog`); :class:`StepSource`
fetches those logs, spreading the requests over the donors, and :func:`replay` runs each step
on the joiner as the members ran it (the trainer's ``apply`` installs the logged gradient
buffer, sets the logged hyperparameters and steps the optimizer with the script's hooks).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from chaos.errors import ChaosTimeout, ReplicationError
from chaos.replication.steplog import LoggedStep, decode_hypers, fetch_steps
from chaos.security import Security
from chaos.trainer.gradients import GradientPacker
from chaos.trainer.session import Policy

__all__ = [
    "CatchUpState",
    "Hooks",
    "Replayed",
    "StepSource",
    "plans_snapshot",
    "replay",
    "run_logged_step",
]

log = logging.getLogger("chaos.trainer")

FETCH_TIMEOUT_S = 5.0
"""Longest wait for one donor's answer to a step-log request."""
ENTRIES_PER_FETCH = 16
"""Steps asked for in one request."""
ENTER_LAG = 1
"""A joiner at most this many steps behind a donor's log asks to enter the data plane."""


Hooks = tuple[
    "Callable[[], object] | None", "Callable[[], object] | None", "Callable[[], object] | None"
]
"""``update()``'s ``before_step``, ``step_fn`` and ``after_step``."""


def plans_snapshot(p: Policy, node_id: str) -> bool:
    """Whether ``p`` plans a catch-up snapshot for ``node_id``."""
    rep = p.replication
    return rep is not None and rep.target == node_id and rep.at_step is not None


def run_logged_step(
    entry: LoggedStep, packer: GradientPacker, optimizer: torch.optim.Optimizer, hooks: Hooks
) -> None:
    """Runs one logged step as the members ran it: their gradient buffer, their
    hyperparameters, this script's hooks (the caller counts the step)."""
    before_step, step_fn, after_step = hooks
    packer.install(entry.grads)
    decode_hypers(entry.hypers, optimizer)
    if before_step is not None:
        before_step()
    if step_fn is not None:
        step_fn()
    else:
        optimizer.step()
    if after_step is not None:
        after_step()


@dataclass
class CatchUpState:
    """What a joiner keeps between its snapshot pull and its entry.

    Attributes:
        donors: Donor id -> shard server address (the snapshot's donors, who log the steps).
        epoch: The epoch of the policy that planned the snapshot.
        started: When the join began (monotonic seconds).
        snapshot_step: The step of the snapshot pulled.
        members: The members of the policy that planned the snapshot (a replayed step the
            members skipped as non-finite names the devices among them).
    """

    donors: dict[str, str]
    epoch: int
    started: float
    snapshot_step: int
    members: tuple[str, ...] = ()


@dataclass(frozen=True)
class Replayed:
    """How a replay ended.

    Attributes:
        steps: Steps replayed.
        lag: Steps the joiner was still behind the donors' logs (``-1``: unknown).
        why: Why it stopped (``"caught up"``, ``"reached"``, or what went wrong).
    """

    steps: int
    lag: int
    why: str


class StepSource:
    """Fetches logged steps from a set of donors, each request from the next donor in turn; a
    donor that fails or refuses is dropped.

    Args:
        donors: Donor id -> shard server address.
        like: A gradient buffer as the joiner packs it (dtype and size of every entry).
        security: The cluster key.
    """

    def __init__(self, donors: dict[str, str], like: torch.Tensor,
                 security: Security | None) -> None:  # fmt: skip
        self.donors = dict(donors)
        self._order = sorted(self.donors)
        self._next = 0
        self._like = like
        self._security = security
        self.failures: dict[str, str] = {}

    def fetch(self, from_step: int) -> tuple[int, int | None, bool, list[LoggedStep]] | None:
        """The next logged steps from ``from_step`` on.

        Returns:
            ``(head, closed_at, stopped, steps)`` of the first donor that answers (see
            :class:`~chaos.replication.wire.StepLogReply`), or ``None`` when no donor is left.
        """
        while self._order:
            donor = self._order[self._next % len(self._order)]
            self._next += 1
            try:
                head, steps = fetch_steps(
                    self.donors[donor], from_step, self._like, FETCH_TIMEOUT_S,
                    max_entries=ENTRIES_PER_FETCH, security=self._security,
                )  # fmt: skip
            except (ReplicationError, ChaosTimeout) as exc:
                self.failures[donor] = str(exc)[:200]
                self._order.remove(donor)
                log.info("step log of %s not usable: %s", donor, exc)
                continue
            return head.head, head.closed_at, head.stopped, steps
        return None


def replay(
    source: StepSource,
    step: int,
    apply: Callable[[LoggedStep], None],
    *,
    until: int | None,
    deadline: float,
    poll_interval_s: float,
    stop: Callable[[], bool] | None = None,
) -> Replayed:
    """Replays logged steps from ``step`` on.

    Args:
        source: Where the steps come from.
        step: The joiner's step now.
        apply: Runs one logged step on the joiner (its step counts one more).
        until: Stop at this step (the step at which the joiner enters); ``None``: stop once at
            most :data:`ENTER_LAG` steps behind.
        deadline: Stop at this time (monotonic) whatever the lag.
        poll_interval_s: Pause when the logs hold no new step yet.
        stop: Asked before each fetch: ``True`` ends the replay (the scheduler put the joiner
            into the data plane without waiting for it).

    Returns:
        How it ended (the caller compares states afterwards: a replay that stopped early only
        means more to pull).
    """
    done, lag = 0, -1
    while until is None or step < until:
        if stop is not None and stop():
            return Replayed(done, lag, "the policy took this trainer in")
        got = source.fetch(step)
        if got is None:
            return Replayed(done, lag, "no donor serves the step log")
        head, closed_at, stopped, steps = got
        for s in steps:
            if until is not None and s.step >= until:
                break
            apply(s)
            step, done = step + 1, done + 1
        lag = head - step
        if until is None and (lag <= ENTER_LAG or closed_at is not None):
            return Replayed(done, lag, "caught up")
        if stopped and step >= head:
            return Replayed(done, lag, "a donor's log stopped")
        if until is not None and closed_at is not None and step >= head:
            return Replayed(done, until - step, f"the log ends at step {head}")
        if time.monotonic() >= deadline:
            return Replayed(done, lag, "catch_up_timeout_s passed")
        if not steps:
            time.sleep(poll_interval_s)
    return Replayed(done, 0, "reached")
