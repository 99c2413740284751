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
