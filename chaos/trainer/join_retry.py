"""How a trainer keeps joining while its donors come and go: the retry policy, apart from the
registration and the pull it retries (:meth:`Trainer._join_until`).

A pull whose donors all went (killed, or cut off by a partition), a registration refused
``no_state_source`` (a scheduler just elected that has not yet heard the state's layout, or a
side whose trainers are all gone for now), and a request still refused for a transient reason
after the session's own retries (``paused``: a minority side; see
:func:`chaos.trainer.session.transient`) are tried again, paced, until a deadline; anything
else, or anything past the deadline, is raised. A cluster that can heal is not given up on
before the user's own limit.

One failure is not retried for ever: the same donor addresses refusing connections
:data:`SAME_FAILURES` times in a row, over :data:`SAME_FAILURES_SPAN_S` at least, is no donor
that died (the scheduler names other donors once it finds one dead, within its failure timeout)
but an address this device cannot reach: a donor that advertised loopback, or an address behind
a firewall. :class:`UnreachableWatch` counts them and raises :class:`DonorAddressUnreachable`,
which names the addresses and what to set.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from chaos.errors import ChaosError, ChaosTimeout, ProtocolError, ReplicationError
from chaos.protocol import Reason
from chaos.protocol.ids import is_loopback_endpoint
from chaos.trainer.session import transient

__all__ = [
    "PAUSE_MAX_S",
    "PAUSE_S",
    "SAME_FAILURES",
    "SAME_FAILURES_SPAN_S",
    "DonorAddressUnreachable",
    "UnreachableWatch",
    "join_until",
]

log = logging.getLogger(__name__)

PAUSE_S = 1.0
"""The pause before another join attempt after a failed one (event ``join_again_failed``) is
this long times the failed attempts so far, at most :data:`PAUSE_MAX_S`."""
PAUSE_MAX_S = 5.0
_NO_SOURCE = Reason.NO_STATE_SOURCE.value
SAME_FAILURES = 3
"""Failures in a row on the same unreachable donor addresses that end the retries..."""
SAME_FAILURES_SPAN_S = 10.0
"""...provided they span at least this long (a dead donor is replaced in the plans sooner)."""


class DonorAddressUnreachable(ReplicationError):
    """The same donor addresses refused this device's connections join after join: the
    donors advertise an address that this device cannot reach (see :class:`UnreachableWatch`).
    A retry cannot change that; the donors' configuration must."""


class UnreachableWatch:
    """Counts the join and entry failures in a row whose donors' addresses refused connections,
    and ends them when they are always the same addresses (pure: times are passed in).

    Args:
        limit: Failures in a row on the same addresses that raise.
        span_s: The least time from the first to the last of them.
    """

    def __init__(self, limit: int = SAME_FAILURES, span_s: float = SAME_FAILURES_SPAN_S) -> None:
        self.limit = limit
        self.span_s = span_s
        self._addresses: tuple[str, ...] = ()
        self._count = 0
        self._since = 0.0

    def reset(self) -> None:
        """The join or entry succeeded: the count starts again."""
        self._addresses, self._count = (), 0

    def failed(self, exc: ChaosError, now: float) -> None:
        """Records a failed join or entry at ``now`` (monotonic seconds).

        Raises:
            DonorAddressUnreachable: the donor addresses that ``exc`` found unreachable
                (:attr:`ReplicationError.unreachable`) are those of the last ``limit - 1``
                failures too, the first of them at least ``span_s`` ago.
        """
        addresses = exc.unreachable if isinstance(exc, ReplicationError) else ()
        if not addresses or addresses != self._addresses:
            self._addresses, self._count, self._since = addresses, 0, now
        if not addresses:
            return
        self._count += 1
        if self._count >= self.limit and now - self._since >= self.span_s:
            why = unreachable_message(addresses, self._count, now - self._since)
            failed = exc.failed_donors if isinstance(exc, ReplicationError) else None
            raise DonorAddressUnreachable(why, failed, unreachable=addresses) from exc


def unreachable_message(addresses: tuple[str, ...], count: int, span_s: float) -> str:
    """What :class:`DonorAddressUnreachable` says: the addresses, and what to set."""
    where = ", ".join(addresses)
    loop = [a for a in addresses if is_loopback_endpoint(a)]
    why = (
        f"{', '.join(loop)} is a loopback address: the donor advertises its data plane on its "
        "own loopback interface, which no other device reaches. "
        if loop
        else "no shard server listens there as seen from this device (a firewall, or an "
        "address of another network). "
    )
    return (
        f"the donors' state address {where} refused this device's connections {count} times in "
        f"a row over {span_s:.0f} s, so joining again cannot help. {why}Start every trainer "
        "with its device's own address: Trainer(..., listen=\"tcp://ADDRESS:PORT\") (the data "
        "plane then uses that address) or the TrainerConfig option host=\"ADDRESS\"; with an "
        "external daemon, set host to the address the other devices reach."
    )


def join_until(
    attempt: Callable[[], None],
    deadline: float,
    node_id: str,
    event: Callable[..., Any],
    watch: UnreachableWatch | None = None,
) -> None:
    """Runs ``attempt`` (register and pull) until it succeeds, retrying what can heal.

    Args:
        attempt: One registration and state pull.
        deadline: ``time.monotonic()`` past which a failure is raised (``math.inf``: never).
        node_id: The trainer's id, for the log.
        event: The trainer's event recorder (``join_again_failed`` with ``attempt``,
            ``error``).
        watch: Counts the failures on unreachable donor addresses (default: a new one).

    Raises:
        ChaosTimeout: the last attempt's join or pull did not finish in time, past the
            deadline.
        ProtocolError: the registration was refused for good (a retry cannot change that),
            or refused ``no_state_source`` or for a transient reason past the deadline.
        ReplicationError: the last attempt could not pull the state, past the deadline.
        DonorAddressUnreachable: the same donor addresses refused connections attempt after
            attempt (see :class:`UnreachableWatch`).
    """
    watch = UnreachableWatch() if watch is None else watch
    tries = 0
    while True:
        tries += 1
        try:
            attempt()
            return
        except (ReplicationError, ChaosTimeout, ProtocolError) as exc:
            if isinstance(exc, ProtocolError) and not (
                getattr(exc, "reason", "") == _NO_SOURCE or transient(exc)
            ):
                raise  # refused for good
            watch.failed(exc, time.monotonic())
            pause = min(PAUSE_MAX_S, PAUSE_S * tries)
            if time.monotonic() + pause >= deadline:
                raise
            event("join_again_failed", attempt=tries, error=str(exc)[:300])
            log.warning("%s: joining failed (%s); trying again in %.0f s", node_id, exc, pause)
            time.sleep(pause)  # paced: donors come back, or the next plan names others
