"""The live progress line of long commands (``chaos-emulate``, ``chaos-bench``).

One tqdm line at the bottom of an interactive terminal (where the run is: seconds of its
timeline, or runs of a series, and a short status), with the run's notes printed above it, each
stamped with the seconds since the start. Without a terminal (a log file, CI) there is no bar:
the notes are plain lines, as before.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

__all__ = ["LiveProgress"]


class LiveProgress:
    """A live progress line with notes above it; callable with a note.

    Args:
        desc: What runs (the bar's label).
        total: The bar's end (seconds of a timeline, runs of a series); ``None``: unknown.
        unit: The unit of ``total``.
        stream: Where it all goes (default: stderr); a bar only on a terminal.
    """

    def __init__(self, desc: str, total: float | None = None, unit: str = "s",
                 stream: TextIO | None = None) -> None:  # fmt: skip
        self._stream = stream if stream is not None else sys.stderr
        self._t0 = time.monotonic()
        isatty = getattr(self._stream, "isatty", None)
        self.interactive = bool(isatty and isatty())
        fmt = None if total is None else ("{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} "
                                          "{unit} [{elapsed}<{remaining}{postfix}]")  # fmt: skip
        self._bar = tqdm(total=total, desc=desc, unit=unit, file=self._stream, leave=False,
                         disable=not self.interactive, dynamic_ncols=True, mininterval=0.5,
                         bar_format=fmt)  # fmt: skip

    def __call__(self, msg: str) -> None:
        """Prints a note above the bar, stamped with the seconds since the start."""
        self.note(msg)

    def note(self, msg: str) -> None:
        """Prints a note above the bar, stamped with the seconds since the start."""
        line = f"[{time.monotonic() - self._t0:7.1f}s] {msg}"
        if self.interactive:
            tqdm.write(line, file=self._stream)
        else:
            print(line, file=self._stream, flush=True)

    def at(self, position: float, status: str = "") -> None:
        """Moves the bar to ``position`` (of ``total``) with a short ``status``."""
        if not self.interactive:
            return
        self._bar.n = position
        if status:
            self._bar.set_postfix_str(status, refresh=False)
        self._bar.refresh()

    def done(self, msg: str) -> None:
        """One unit of ``total`` is done (a run of a series): prints ``msg`` above the bar and
        moves the bar one further."""
        self.note(msg)
        self.advance(1.0)

    def reset(self, total: float | None, desc: str | None = None) -> None:
        """Starts the bar again towards ``total`` (a new phase), keeping the notes' clock."""
        if desc is not None:
            self._bar.set_description_str(desc, refresh=False)
        self._bar.reset(total=total)

    def advance(self, n: float = 1.0, status: str = "") -> None:
        """Moves the bar ``n`` further."""
        self.at(self._bar.n + n, status)

    def close(self) -> None:
        """Removes the bar (the notes stay)."""
        self._bar.close()

    def __enter__(self) -> LiveProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
