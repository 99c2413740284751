"""Lifecycle enums of the local daemon: its own state and its election role.

A node's state and its trainer's state in the cluster view travel on the wire, so they live in
:mod:`chaos.protocol.states`.
"""

from __future__ import annotations

import enum


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
