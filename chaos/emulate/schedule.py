"""Link bandwidths that change over time, and random overlays.

:class:`BandwidthSchedule` draws every link's rate uniformly from a range (the paper: 100-1000
Mbit/s, redrawn every 3 minutes), multiplied by a ``scale`` factor so that a scenario fits a small
machine. Draws come from a seeded RNG, so a run is reproducible.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol


class _Shapeable(Protocol):
    def links(self) -> Mapping[tuple[str, str], object]: ...

    def set_bandwidth(self, a: str, b: str, bandwidth_bps: float) -> None: ...


@dataclass(frozen=True)
class ScheduleConfig:
    """Bandwidth schedule settings.

    Args:
        low_bps: Lower end of the range, before scaling.
        high_bps: Upper end of the range, before scaling.
        period_s: Time between redraws. The paper uses 180 s.
        scale: Factor applied to every drawn rate (and, by the caller, to model sizes); below 1
            to fit a scenario on few cores.
        seed: RNG seed.
    """

    low_bps: float = 100e6
    high_bps: float = 1000e6
    period_s: float = 180.0
    scale: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("low_bps", "high_bps", "period_s", "scale"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
            if v <= 0:
                raise ValueError(f"{name} must be positive, got {v}")
        if self.low_bps > self.high_bps:
            raise ValueError(f"low_bps {self.low_bps} exceeds high_bps {self.high_bps}")
        if self.low_bps * self.scale < 8000:
            raise ValueError("scaled bandwidth below 8 kbit/s: raise low_bps or scale")
        if not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")


class BandwidthSchedule:
    """Draws link rates and, once started, redraws them on a network every period."""

    def __init__(self, config: ScheduleConfig) -> None:
        self.config = config
        self._round = 0  # redraws so far: a link's rate depends on (seed, link, round) only
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.history: list[dict[tuple[str, str], float]] = []

    def draw(self, links: Iterable[tuple[str, str]]) -> dict[tuple[str, str], float]:
        """One scaled rate per link for the current period.

        A link's rate depends only on the seed, its two ends (in either order) and how many
        redraws came before, not on which other links were drawn first. So runs that add links
        in a different order or add extra links (e.g. one baseline against another in
        ``chaos-emulate compare``) see the same rate on the same link.
        """
        c = self.config
        out: dict[tuple[str, str], float] = {}
        for a, b in links:
            lo, hi = sorted((a, b))
            rng = random.Random(f"{c.seed}:{lo}:{hi}:{self._round}")
            out[(a, b)] = rng.uniform(c.low_bps, c.high_bps) * c.scale
        return out

    def apply(self, network: _Shapeable) -> dict[tuple[str, str], float]:
        """Draws new rates for every link of ``network`` and sets them.

        Returns:
            The rates set, by link.

        Raises:
            NetworkSetupError: tc failed.
        """
        self._round += 1
        rates = self.draw(sorted(network.links()))
        for (a, b), bps in rates.items():
            network.set_bandwidth(a, b, bps)
        self.history.append(rates)
        return rates

    def start(self, network: _Shapeable) -> None:
        """Redraws every ``period_s`` in a background thread until :meth:`stop`.

        Raises:
            RuntimeError: already started.
        """
        if self._thread is not None:
            raise RuntimeError("schedule already started")

        def loop() -> None:
            while not self._stop.wait(self.config.period_s):
                self.apply(network)

        self._thread = threading.Thread(target=loop, name="bandwidth-schedule", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stops redrawing; waits up to ``timeout_s`` for a redraw in progress."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)


def random_overlay(n: int, degree: int = 2, seed: int = 0) -> list[tuple[str, str]]:
    """A random connected overlay of ``n`` nodes ``n0..n{n-1}``, built as the paper grows one.

    Each new node connects to ``degree`` distinct random earlier nodes (all of them while fewer
    exist), so the overlay is connected and has about ``degree * n`` links.

    Raises:
        ValueError: ``n < 1`` or ``degree < 1``.
    """
    if n < 1 or degree < 1:
        raise ValueError(f"need n >= 1 and degree >= 1, got n={n}, degree={degree}")
    rng = random.Random(seed)
    names = [f"n{i}" for i in range(n)]
    edges = []
    for i in range(1, n):
        for j in sorted(rng.sample(range(i), min(degree, i))):
            edges.append((names[j], names[i]))
    return edges
