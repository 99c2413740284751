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


class CounterLimit(ChaosError):
    """A term or an epoch is at the wire limit (:data:`~chaos.protocol.MAX_COUNTER`): the next
    one could not be encoded, so it is not made."""


class ProtocolError(ChaosError):
    """A wire message is malformed, oversized, of the wrong version or otherwise refused."""


class DaemonGone(ChaosError):
    """The daemon exited before it answered a request (for a leave: it left on its own)."""


class SolverError(ChaosError):
    """A reference solver (MILP) failed to produce a usable solution."""


class PeerFailure(ChaosError):
    """A collective could not finish because a neighbour failed, timed out or was reported dead.

    The caller's input tensor is untouched; the step can be rerun after the communicator's topology
    has been updated (a new membership epoch).

    Attributes:
        peer: The node id that failed, as far as this node can tell (the neighbour that stopped
            sending, or the peer named in an abort notice).
        reported_by: The node that reported it (this node, or the neighbour whose abort notice
            arrived).
        timed_out: Whether this node saw a receive timeout (rather than a disconnect or a notice).
    """

    def __init__(
        self, peer: str, reason: str, *, reported_by: str = "", timed_out: bool = False
    ) -> None:
        super().__init__(f"peer {peer!r} failed: {reason}")
        self.peer = peer
        self.reason = reason
        self.reported_by = reported_by
        self.timed_out = timed_out


class PeerTimeout(PeerFailure, ChaosTimeout):
    """A neighbour sent nothing (or took no frames) within the collective's timeout."""

    def __init__(self, peer: str, reason: str, *, reported_by: str = "") -> None:
        super().__init__(peer, reason, reported_by=reported_by, timed_out=True)


class StateLayoutError(ChaosError, ValueError):
    """A training-state stream has another layout (tensor names, shapes, dtypes, optimizer) than
    the state it is meant for, or its header is malformed; nothing was loaded."""


class ReplicationError(ChaosError):
    """State replication to a joining node failed: no donor is left (all died or refused), or a
    shard could not be fetched intact from any donor.

    Attributes:
        failed_donors: Donor id -> why it was dropped (a refusal reason code, ``"timeout"``,
            ``"disconnected"``).
        unreachable: The donor addresses that refused connections (nothing listens there,
            from this device), sorted; empty when no donor was unreachable.
    """

    def __init__(self, message: str, failed_donors: dict[str, str] | None = None, *,
                 unreachable: tuple[str, ...] = ()) -> None:  # fmt: skip
        super().__init__(message)
        self.failed_donors = dict(failed_donors or {})
        self.unreachable = tuple(sorted(set(unreachable)))


class RoundInterrupted(PeerFailure):
    """A collective was aborted because a newer membership epoch is in force.

    Nothing failed: the caller installs the new policy and reruns the step. The input tensor is
    untouched, as for every :class:`PeerFailure`.
    """

    def __init__(self, reason: str, *, reported_by: str = "") -> None:
        super().__init__("", reason, reported_by=reported_by)
        self.args = (f"allreduce interrupted: {reason}",)


class NonFiniteGradient(ChaosError):
    """A step's averaged gradients were not finite (NaN or inf, or a device's gradients over
    ``TrainerConfig.max_grad_norm``), with ``TrainerConfig.nonfinite="raise"``: every member
    raises it in the same ``update()``, none having stepped its optimizer.

    Attributes:
        step: The step whose gradients were bad.
        devices: The members whose contribution was bad, sorted (empty: the sum of finite
            contributions overflowed).
    """

    def __init__(self, message: str, *, step: int, devices: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.step = step
        self.devices = tuple(devices)
