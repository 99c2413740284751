"""The lifecycle of a node and of its trainer in the scheduler's cluster view.

Both travel on the wire (:class:`~chaos.protocol.messages.NodeInfo`,
:class:`~chaos.protocol.messages.AgentReport`); msgspec encodes a ``str`` enum as its value, so
these enums are the wire's vocabulary too, with no separate ``Literal`` copy.
"""

from __future__ import annotations

import enum


class NodeState(str, enum.Enum):
    """A node's state in the scheduler's cluster view.

    Allowed transitions::

        joining -> active        (scale-out finished: links measured, policies issued)
        joining -> failed        (the joiner died or no link to it came up)
        active  -> leaving       (graceful leave: scale-in)
        active  -> failed        (missed heartbeats: scale-in for a failure)
        leaving -> (removed)     (the view of the next epoch no longer holds it)
        failed  -> (removed)
    """

    JOINING = "joining"
    ACTIVE = "active"
    LEAVING = "leaving"
    FAILED = "failed"


NODE_TRANSITIONS: dict[NodeState, frozenset[NodeState]] = {
    NodeState.JOINING: frozenset({NodeState.ACTIVE, NodeState.FAILED}),
    NodeState.ACTIVE: frozenset({NodeState.LEAVING, NodeState.FAILED}),
    NodeState.LEAVING: frozenset(),
    NodeState.FAILED: frozenset(),
}


class TrainerState(str, enum.Enum):
    """Whether a node takes part in training (its data-plane membership), in the scheduler's view.

    Allowed transitions::

        none     -> training  (the first trainer registers with a state)
        none     -> syncing   (a trainer without state registers: it receives it by replication)
        syncing  -> training  (the trainer reported ``ready``)
        training -> syncing   (its trainer restarted without state while another node trains)
        syncing  -> syncing, training -> training   (re-registration, e.g. new tensor sizes)
        syncing  -> none, training -> none   (its daemon saw the trainer's process exit)
        any      -> (removed) (the node leaves or fails with its daemon)
    """

    NONE = "none"
    SYNCING = "syncing"
    TRAINING = "training"


TRAINER_TRANSITIONS: dict[TrainerState, frozenset[TrainerState]] = {
    TrainerState.NONE: frozenset({TrainerState.SYNCING, TrainerState.TRAINING}),
    TrainerState.SYNCING: frozenset(
        {TrainerState.NONE, TrainerState.SYNCING, TrainerState.TRAINING}
    ),
    TrainerState.TRAINING: frozenset(
        {TrainerState.NONE, TrainerState.SYNCING, TrainerState.TRAINING}
    ),
}


class TrainerPhase(str, enum.Enum):
    """Where a :class:`~chaos.trainer.Trainer` is in its own lifecycle, as it reports it
    (:class:`~chaos.protocol.messages.TrainerProgress`'s ``phase``); the trainer moves along
    :data:`PHASE_TRANSITIONS` only (:mod:`chaos.trainer.lifecycle` enforces it and says why
    each move is allowed).

    Allowed transitions::

        joining     -> pulling, live
        pulling     -> live, catching_up, joining
        catching_up -> entering, rejoining
        entering    -> live, rejoining
        live        -> stalled, paused, rejoining
        stalled     -> live, paused, rejoining
        paused      -> stalled, live, rejoining
        rejoining   -> joining
        any but leaving and closed -> leaving
        leaving     -> closed
    """

    JOINING = "joining"
    PULLING = "pulling"
    CATCHING_UP = "catching_up"
    ENTERING = "entering"
    LIVE = "live"
    STALLED = "stalled"
    PAUSED = "paused"
    REJOINING = "rejoining"
    LEAVING = "leaving"
    CLOSED = "closed"


def _phases(*names: TrainerPhase) -> frozenset[TrainerPhase]:
    return frozenset((*names, TrainerPhase.LEAVING))


PHASE_TRANSITIONS: dict[TrainerPhase, frozenset[TrainerPhase]] = {
    TrainerPhase.JOINING: _phases(TrainerPhase.PULLING, TrainerPhase.LIVE),
    TrainerPhase.PULLING: _phases(
        TrainerPhase.LIVE, TrainerPhase.CATCHING_UP, TrainerPhase.JOINING
    ),
    TrainerPhase.CATCHING_UP: _phases(TrainerPhase.ENTERING, TrainerPhase.REJOINING),
    TrainerPhase.ENTERING: _phases(TrainerPhase.LIVE, TrainerPhase.REJOINING),
    TrainerPhase.LIVE: _phases(TrainerPhase.STALLED, TrainerPhase.PAUSED, TrainerPhase.REJOINING),
    TrainerPhase.STALLED: _phases(
        TrainerPhase.LIVE, TrainerPhase.PAUSED, TrainerPhase.REJOINING
    ),
    TrainerPhase.PAUSED: _phases(
        TrainerPhase.STALLED, TrainerPhase.LIVE, TrainerPhase.REJOINING
    ),
    TrainerPhase.REJOINING: _phases(TrainerPhase.JOINING),
    TrainerPhase.LEAVING: frozenset({TrainerPhase.CLOSED}),
    TrainerPhase.CLOSED: frozenset(),
}
