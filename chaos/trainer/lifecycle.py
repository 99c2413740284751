"""The Trainer's lifecycle: one state at a time, and only the moves the table allows.

A :class:`~chaos.trainer.Trainer` is in exactly one :class:`TrainerPhase`. Every move goes
through :class:`Lifecycle`, which refuses one the table does not list (an
:class:`IllegalTransition`, a bug in this package, never a user's error) and tells a listener
(the trainer's ``phase`` event), so a reader of the events sees each move with the step it
happened at. The daemon's ``status`` shows the phase its trainer last reported.

Allowed transitions (``chaos.protocol.states.PHASE_TRANSITIONS``), and what makes each::

    joining     -> pulling      the policy names donors: the state is pulled
    joining     -> live         no state to pull (the first member, or one that holds it)
    pulling     -> live         the state is pulled (a barrier join)
    pulling     -> catching_up  the donors' snapshot is pulled (or could not be: it enters
                                pulling the whole state); the constructor returns
    pulling     -> joining      the pull failed: it registers again
    catching_up -> entering     it replayed the logged steps and asked to enter
    catching_up -> rejoining    its catch-up report was refused (a new scheduler)
    entering    -> live         it entered (the entry step follows, with weight 0)
    entering    -> rejoining    the entry pull failed (no donor, the donors were gone)
    live        -> stalled      an allreduce failed or was interrupted: it waits for a policy
    live, stalled -> paused     its daemon is paused (a minority side of a partition) while
                                it waits in a round or for the policy to rerun one under
    paused      -> stalled      its daemon is no longer paused, the wait goes on
    stalled, paused -> live     the rerun's policy is installed
    live, stalled, paused -> rejoining   evicted (a straggler, an offender), or the state
                                audit found this member different: it joins again
    rejoining   -> joining      it registers again
    any but leaving and closed -> leaving   close()
    leaving     -> closed

The phases travel on the wire in the trainer's progress beacon
(:class:`~chaos.protocol.messages.TrainerProgress`), so the enum lives in
:mod:`chaos.protocol.states` with the other lifecycles; this module enforces its moves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from chaos.protocol.states import PHASE_TRANSITIONS, TrainerPhase

__all__ = ["IllegalTransition", "Lifecycle", "TrainerPhase", "PHASE_TRANSITIONS"]


class IllegalTransition(RuntimeError):
    """A move the lifecycle's table does not allow (a bug in this package)."""


Listener = Callable[[TrainerPhase, TrainerPhase, str], None]
"""Called with ``(old, new, why)`` after each move."""


class Lifecycle:
    """The Trainer's current :class:`TrainerPhase`, moved only along the table.

    Args:
        node_id: Named in errors.
        listener: Told of each move, after it (``old``, ``new``, ``why``).
        start: The phase it starts in.
    """

    def __init__(
        self,
        node_id: str,
        listener: Listener | None = None,
        start: TrainerPhase = TrainerPhase.JOINING,
    ) -> None:
        self._node_id = node_id
        self._listener = listener
        self._phase = start
        self._lock = threading.Lock()  # the daemon's thread reads it for the beacon

    @property
    def phase(self) -> TrainerPhase:
        """The phase now."""
        return self._phase

    def move(self, new: TrainerPhase, why: str = "") -> None:
        """Moves to ``new``; staying where it is is a no-op.

        Args:
            new: The next phase.
            why: What made it move (for the event).

        Raises:
            IllegalTransition: the table does not allow ``phase -> new``.
        """
        with self._lock:
            old = self._phase
            if new is old:
                return
            if new not in PHASE_TRANSITIONS[old]:
                raise IllegalTransition(
                    f"{self._node_id}: the trainer cannot go from {old.value} to {new.value}"
                    f"{f' ({why})' if why else ''}: not in chaos.protocol.states.PHASE_TRANSITIONS"
                )
            self._phase = new
        if self._listener is not None:
            self._listener(old, new, why)
