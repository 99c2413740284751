"""How a trainer keeps joining while its donors come and go: the retry policy, apart from the
registration and the pull it retries (:meth:`Trainer._join_until`).

A pull whose donors all went (killed, or cut off by a partition), a registration refused
``no_state_source`` (a scheduler just elected that has not yet heard the state's layout, or a
side whose trainers are all gone for now), and a request still refused for a transient reason
after the session's own retries (``paused``: a minority side; see
:func:`chaos.trainer.session.transient`) are tried again, paced, until a deadline; anything
else, or anything past the deadline, is raised. A cluster that can heal is not given up on
before the user's own limit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from chaos.errors import ChaosTimeout, ProtocolError, ReplicationError
from chaos.protocol import Reason
from chaos.trainer.session import transient

__all__ = ["PAUSE_MAX_S", "PAUSE_S", "join_until"]

log = logging.getLogger(__name__)

PAUSE_S = 1.0
"""The pause before another join attempt after a failed one (event ``join_again_failed``) is
this long times the failed attempts so far, at most :data:`PAUSE_MAX_S`."""
PAUSE_MAX_S = 5.0
_NO_SOURCE = Reason.NO_STATE_SOURCE.value


def join_until(attempt: Callable[[], None], deadline: float, node_id: str,
               event: Callable[..., Any]) -> None:  # fmt: skip
    """Runs ``attempt`` (register and pull) until it succeeds, retrying what can heal.

    Args:
        attempt: One registration and state pull.
        deadline: ``time.monotonic()`` past which a failure is raised (``math.inf``: never).
        node_id: The trainer's id, for the log.
        event: The trainer's event recorder (``join_again_failed`` with ``attempt``,
            ``error``).

    Raises:
        ChaosTimeout: the last attempt's join or pull did not finish in time, past the
            deadline.
        ProtocolError: the registration was refused for good (a retry cannot change that),
            or refused ``no_state_source`` or for a transient reason past the deadline.
        ReplicationError: the last attempt could not pull the state, past the deadline.
    """
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
            pause = min(PAUSE_MAX_S, PAUSE_S * tries)
            if time.monotonic() + pause >= deadline:
                raise
            event("join_again_failed", attempt=tries, error=str(exc)[:300])
            log.warning("%s: joining failed (%s); trying again in %.0f s", node_id, exc, pause)
            time.sleep(pause)  # paced: donors come back, or the next plan names others
