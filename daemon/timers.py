"""The event loop's timers: when each periodic job of the daemon is next due."""

from __future__ import annotations


class Timers:
    """Named deadlines (monotonic time); the loop sleeps until the earliest.

    A timer never set is due at once.
    """

    def __init__(self) -> None:
        self.due: dict[str, float] = {}

    def is_due(self, name: str, now: float) -> bool:
        """Whether timer ``name`` is due at ``now``."""
        return now >= self.due.get(name, 0.0)

    def set(self, name: str, at: float) -> None:
        """Makes timer ``name`` due at ``at``."""
        self.due[name] = at

    def wake(self, name: str, now: float) -> None:
        """Makes timer ``name`` due at once."""
        self.due[name] = now

    def next(self) -> float:
        """The earliest deadline (``inf`` with no timer)."""
        return min(self.due.values(), default=float("inf"))
