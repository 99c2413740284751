"""Shared pytest configuration.

Hypothesis runs derandomized and without its example database, so every run of the suite tries
the same examples; no per-example deadline, because tests never assert timing.
"""

from __future__ import annotations

from hypothesis import settings

settings.register_profile("chaos", derandomize=True, database=None, deadline=None)
settings.load_profile("chaos")
