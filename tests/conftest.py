"""Shared pytest configuration.

Hypothesis runs derandomized and without its example database, so every run of the suite tries
the same examples; no per-example deadline, because tests never assert timing.
"""

from __future__ import annotations

from hypothesis import settings

settings.register_profile("chaos", derandomize=True, database=None, deadline=None)
settings.load_profile("chaos")


def pytest_sessionstart(session: object) -> None:
    """Build (or reuse) the native extension once, before any test spawns a process.

    Without this, the first test whose subprocess touches a native op would pay the ~30 s
    compile inside its own protocol timeouts. A failed build only warns here; the native
    tests then fail with the reason.
    """
    from chaos import ops

    ops.native_available()
