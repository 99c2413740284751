"""The outer allreduce in the background: local steps whose synchronisation overlaps the next
inner phase (DiLoCo with a one-step delay).

Without overlap a member stops computing at every outer boundary until the outer allreduce
returns, and on a slow link that can take as long as many inner steps. With overlap the member
starts the outer step on a background thread (:class:`BackgroundSync`) and goes on with its next
inner phase at once, from where its model is; the links carry the pseudo-gradients while the
member computes. At the next boundary it waits for that outer step (normally long done), and
rebases its model on the new global parameters (:func:`rebase`):

- phase ``k`` runs from its *anchor* ``a_k`` (the model's parameters when it began) to ``x_k``;
  its pseudo-gradient is ``d_k = a_k - x_k``, this member's progress in the phase;
- at the end of phase ``k`` the outer step of ``d_{k-1}`` has produced the global parameters
  ``G``; the model becomes ``G - d_k`` (the new global parameters plus this phase's own
  progress), which is also the next phase's anchor, and the outer step of ``d_k`` starts.

So every pseudo-gradient is applied one outer step late, and the global parameters and the
outer optimizer's state stay exactly what the members agree on: the rebase changes only the
member's local parameters. The first phase starts from the global parameters (``d_0`` is the
first thing sent).

:func:`rebase` and :func:`progress` are pure; :class:`BackgroundSync` owns the thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from chaos.errors import ChaosTimeout

__all__ = ["BackgroundSync", "SyncTimeout", "progress", "rebase"]


class SyncTimeout(ChaosTimeout):
    """The background outer step did not finish within ``sync_timeout_s``."""


def progress(anchor: Sequence[torch.Tensor], local: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A phase's pseudo-gradient ``anchor - local`` (its own progress), one tensor a parameter.

    Raises:
        ValueError: the two lists differ in length or a pair in shape.
    """
    if len(anchor) != len(local):
        raise ValueError(f"{len(anchor)} anchors, {len(local)} local parameters")
    out = []
    for a, p in zip(anchor, local, strict=True):
        if a.shape != p.shape:
            raise ValueError(f"shapes differ: anchor {tuple(a.shape)}, local {tuple(p.shape)}")
        out.append(a.detach() - p.detach().to(device=a.device, dtype=a.dtype))
    return out


def rebase(
    local: Sequence[torch.Tensor],
    global_params: Sequence[torch.Tensor],
    delta: Sequence[torch.Tensor],
) -> None:
    """Sets each local parameter to ``global - delta``: the new global parameters plus the
    progress ``delta`` the member made since its last boundary.

    Raises:
        ValueError: the lists differ in length.
    """
    if not len(local) == len(global_params) == len(delta):
        raise ValueError(f"{len(local)} local, {len(global_params)} global, {len(delta)} deltas")
    with torch.no_grad():
        for p, g, d in zip(local, global_params, delta, strict=True):
            p.copy_(g.detach().to(device=p.device, dtype=p.dtype)
                    - d.to(device=p.device, dtype=p.dtype))  # fmt: skip


class BackgroundSync:
    """At most one outer step at a time on a thread of its own.

    :meth:`start` runs ``fn()`` on a new thread; :meth:`wait` blocks until it has returned and
    hands back its result, or raises what it raised. Nothing else may use the Trainer while a
    step runs: the caller waits first.

    Args:
        timeout_s: How long :meth:`wait` waits at most.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._thread: threading.Thread | None = None
        self._result: Any = None
        self._error: BaseException | None = None
        self.started_at = 0.0
        self.took_s = 0.0

    @property
    def running(self) -> bool:
        """Whether an outer step is in flight."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def pending(self) -> bool:
        """Whether a step was started and not yet waited for."""
        return self._thread is not None

    def start(self, fn: Callable[[], Any], name: str) -> None:
        """Runs ``fn()`` on a new thread.

        Raises:
            RuntimeError: a step is still pending (:meth:`wait` for it first).
        """
        if self._thread is not None:
            raise RuntimeError("an outer step is still pending; wait for it first")
        self._result, self._error = None, None
        self.started_at = time.monotonic()

        def run() -> None:
            try:
                self._result = fn()
            except BaseException as exc:  # handed to the waiting thread, raised there
                self._error = exc
            finally:
                self.took_s = time.monotonic() - self.started_at

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def wait(self) -> Any:
        """Waits for the pending step and returns its result (``None`` when none is pending).

        Raises:
            SyncTimeout: it did not end within :attr:`timeout_s`.
            BaseException: whatever the step raised.
        """
        thread = self._thread
        if thread is None:
            return None
        thread.join(self.timeout_s)
        if thread.is_alive():
            raise SyncTimeout(f"the background outer step has run {self.timeout_s:.0f} s "
                              "without ending")  # fmt: skip
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._result
