"""The event loop's timers: when each periodic job of the daemon is next due, and the guard
every job runs under."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("chaos.daemon")

ErrorSink = Callable[[str, str, BaseException], None]
"""Told of a job that raised: ``(where, job name, exception)``."""


class Timers:
    """Named deadlines (monotonic time); the loop sleeps until the earliest.

    A timer never set is due at once.

    Args:
        on_error: Told of every job that raised in :meth:`call` (the daemon counts it and writes
            an event); the job is logged with its traceback either way.
    """

    def __init__(self, on_error: ErrorSink | None = None) -> None:
        self.due: dict[str, float] = {}
        self.on_error = on_error
        self.errors = 0
        """Jobs that raised so far."""

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

    def call(self, name: str, job: Callable[..., Any], *args: Any) -> bool:
        """Runs one periodic job; an exception is logged at ERROR with its traceback, reported
        to ``on_error`` and swallowed, so one failing job never stops the loop or the others.

        Args:
            name: The job's name, for the log and the event.
            job: The callable.
            *args: Its arguments.

        Returns:
            ``False`` when the job raised.
        """
        try:
            job(*args)
        except Exception as exc:  # a bug must not take the control plane down
            self.errors += 1
            log.exception("timer job %s failed", name)
            if self.on_error is not None:
                try:
                    self.on_error("timer", name, exc)
                except Exception:  # noqa: BLE001 - reporting must not raise either
                    log.exception("reporting the failure of timer job %s failed", name)
            return False
        return True
