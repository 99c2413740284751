"""What any of the daemon's collaborators may read of it: its lifecycle, epoch, term and pause.

Each collaborator names what it needs of the daemon as a small :class:`typing.Protocol` of its
own; those that read these facts extend :class:`MemberFacts` instead of repeating them.
"""

from __future__ import annotations

from typing import Protocol

from chaos.daemon.states import DaemonState


class MemberFacts(Protocol):
    """The daemon's read-only state, as its collaborators see it."""

    node_id: str

    @property
    def state(self) -> DaemonState:
        """The daemon's lifecycle state."""

    @property
    def epoch(self) -> int:
        """The membership epoch of the installed view."""

    @property
    def term(self) -> int:
        """The election term this node knows."""

    @property
    def paused(self) -> bool:
        """Whether the node pauses (no scheduler with a majority)."""
