"""A member's measured throughput: samples per second of its own compute.

The clock runs from the moment ``update()`` returns (the script computes the next step) to the
next ``update()`` call; allreduce waits are not in it. A joiner's clock starts at its first
``update()``'s return, not when the constructor returns (what a script does first, waiting for
the world or loading data, is not a step's compute).
"""

from __future__ import annotations

import time

__all__ = ["THROUGHPUT_SMOOTHING", "ThroughputMeter"]

THROUGHPUT_SMOOTHING = 0.3
"""Weight of the newest step in the measured throughput (an exponential average)."""


class ThroughputMeter:
    """Samples per second of compute between two ``update()`` calls, smoothed."""

    def __init__(self) -> None:
        self.samples_per_s: float | None = None
        """The smoothed throughput (``None`` before two steps)."""
        self._since: float | None = None

    def computing(self) -> None:
        """``update()`` returned: the script computes from now."""
        self._since = time.monotonic()

    def stop(self) -> None:
        """The clock stops without a measurement (ready, or a step that was not computed)."""
        self._since = None

    def measure(self, samples: int | None) -> float | None:
        """``update()`` was called for ``samples``: takes the step's rate into the average.

        Returns:
            The smoothed throughput when this step was measured, else ``None``.
        """
        now = time.monotonic()
        since, self._since = self._since, None
        if since is None or samples is None or now <= since:
            return None
        rate = samples / (now - since)
        old, a = self.samples_per_s, THROUGHPUT_SMOOTHING
        self.samples_per_s = rate if old is None else (1 - a) * old + a * rate
        return self.samples_per_s
