"""What a joiner shows of its state pull: a progress bar on an interactive terminal (tqdm),
a log line every few seconds otherwise (a service's log, a file).

Internal to :mod:`chaos.trainer`: :class:`~chaos.trainer.donor.Donor` hands a
:class:`PullProgress` to :func:`~chaos.replication.pull.pull_state` as its ``on_progress``.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping
from typing import TextIO

from tqdm import tqdm

log = logging.getLogger("chaos.trainer.pull")

MB = 1e6

Listener = Callable[[int, int, Mapping[str, int], bool], None]
"""Told of a pull: bytes done, bytes in all, bytes per donor, and whether it ended."""


class PullProgress:
    """One pull's progress, shown as it goes.

    Args:
        node_id: The joiner (the bar's and the lines' label).
        interval_s: Seconds between two log lines (without a terminal).
        stream: Where the bar goes; it is a bar only when this is a terminal.
        listener: Also told of every step, and of the end (its daemon, which shows the join's
            progress in ``status``).
    """

    def __init__(self, node_id: str, interval_s: float, stream: TextIO | None = None,
                 listener: Listener | None = None) -> None:  # fmt: skip
        self._node = node_id
        self._listener = listener
        self._per_donor: dict[str, int] = {}
        self._interval_s = interval_s
        self._stream = stream if stream is not None else sys.stderr
        self._bar: tqdm | None = None
        self._done = 0
        self._total = 0
        self._started = time.monotonic()
        self._next_line = self._started + interval_s
        self.lines = 0
        """Log lines written so far (for tests)."""

    @property
    def interactive(self) -> bool:
        """Whether the progress shows as a bar (the stream is a terminal)."""
        isatty = getattr(self._stream, "isatty", None)
        return bool(isatty and isatty())

    def __call__(self, done: int, total: int, per_donor: Mapping[str, int]) -> None:
        """A verified shard: ``done`` of ``total`` bytes, ``per_donor`` the bytes of each."""
        self._total = total
        self._per_donor = dict(per_donor)
        if self._listener is not None:
            self._listener(done, total, per_donor, False)
        step, self._done = done - self._done, done
        donors = ", ".join(f"{d} {b / MB:.1f} MB" for d, b in sorted(per_donor.items()) if b)
        if self.interactive:
            if self._bar is None:
                self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000,
                                 desc=f"{self._node} pulling", file=self._stream, leave=True,
                                 mininterval=0.2, dynamic_ncols=True)  # fmt: skip
            self._bar.update(step)
            self._bar.set_postfix_str(donors, refresh=False)
            return
        now = time.monotonic()
        if now >= self._next_line:
            self._next_line = now + self._interval_s
            self._line(now, donors)

    def _line(self, now: float, donors: str) -> None:
        elapsed = max(1e-9, now - self._started)
        log.info("%s: pulled %.1f of %.1f MB (%.0f%%, %.1f MB/s) from %s", self._node,
                 self._done / MB, self._total / MB, 100 * self._done / max(1, self._total),
                 self._done / MB / elapsed, donors or "no donor yet")  # fmt: skip
        self.lines += 1

    def close(self) -> None:
        """Ends the bar, or writes the last line (bytes, mean rate); tells the listener."""
        if self._listener is not None and self._done:
            self._listener(self._done, self._total, self._per_donor, True)
        if self._bar is not None:
            self._bar.refresh()  # the last update may have come within mininterval
            self._bar.close()
            self._bar = None
        elif self._done:  # the last line, however short the pull
            self._line(time.monotonic(), "its donors")
