"""Lifecycle enums of the daemon and of the nodes in the cluster view."""

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
        any      -> (removed) (the node leaves or fails with its daemon)
    """

    NONE = "none"
    SYNCING = "syncing"
    TRAINING = "training"


TRAINER_TRANSITIONS: dict[TrainerState, frozenset[TrainerState]] = {
    TrainerState.NONE: frozenset({TrainerState.SYNCING, TrainerState.TRAINING}),
    TrainerState.SYNCING: frozenset({TrainerState.SYNCING, TrainerState.TRAINING}),
    TrainerState.TRAINING: frozenset({TrainerState.SYNCING, TrainerState.TRAINING}),
}


class DaemonState(str, enum.Enum):
    """The local daemon's lifecycle.

    Allowed transitions::

        starting -> joining   (--join given: join request sent)
        starting -> active    (no --join: a new one-node cluster)
        joining  -> active    (a cluster update lists this node)
        active   -> joining   (a cluster update dropped this node, e.g. after a partition heals:
                               it joins again)
        active   -> leaving   (leave command, SIGINT or SIGTERM)
        joining  -> stopped   (join refused or timed out)
        leaving  -> stopped
        active   -> stopped   (fatal error)
    """

    STARTING = "starting"
    JOINING = "joining"
    ACTIVE = "active"
    LEAVING = "leaving"
    STOPPED = "stopped"


DAEMON_TRANSITIONS: dict[DaemonState, frozenset[DaemonState]] = {
    DaemonState.STARTING: frozenset({DaemonState.JOINING, DaemonState.ACTIVE}),
    DaemonState.JOINING: frozenset({DaemonState.ACTIVE, DaemonState.STOPPED}),
    DaemonState.ACTIVE: frozenset({DaemonState.JOINING, DaemonState.LEAVING, DaemonState.STOPPED}),
    DaemonState.LEAVING: frozenset({DaemonState.STOPPED}),
    DaemonState.STOPPED: frozenset(),
}


class Role(str, enum.Enum):
    """Raft role.

    Allowed transitions::

        follower  -> candidate  (election timeout without a scheduler)
        candidate -> scheduler  (votes from a majority of the current membership)
        candidate -> follower   (a scheduler of an equal or higher term is heard)
        scheduler -> follower   (a higher term is seen, or the majority is lost)
    """

    FOLLOWER = "follower"
    CANDIDATE = "candidate"
    SCHEDULER = "scheduler"
