"""Exception hierarchy shared by every Chaos component.

Every timeout raised by Chaos is a :class:`ChaosTimeout`, itself a subclass of the built-in
:class:`TimeoutError`, so callers can catch either.
"""

from __future__ import annotations


class ChaosError(Exception):
    """Base class of every error Chaos raises on purpose."""


class ChaosTimeout(ChaosError, TimeoutError):
    """A blocking call did not finish within its timeout (seconds)."""


class ConfigError(ChaosError, ValueError):
    """A configuration value, file or command-line argument is invalid."""


class ProtocolError(ChaosError):
    """A wire message is malformed, oversized, of the wrong version or otherwise refused."""


class SolverError(ChaosError):
    """A reference solver (MILP) failed to produce a usable solution."""
