"""The crypto of sealed payload lanes: AES-256-GCM records and the workers that seal them.

A sealed lane (see :mod:`chaos.collectives.lane_wire` for what it carries) writes every byte as
an AES-256-GCM record under the fresh key of the offer it answers. :class:`LaneCipher` numbers
one direction's records so that none can be dropped, reordered or replayed unnoticed; the
record workers (:func:`crypto_workers`) seal and open a large payload's records on a few
threads beside the ones that write and read them, so that the crypto overlaps the transfer.
"""

from __future__ import annotations

import _thread
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from chaos.wire import LANE_NONCE as _NONCE
from chaos.wire import LANE_RECORD_BYTES

__all__ = [
    "LANE_KEY_BYTES", "MAX_ATTEMPT", "TAG_BYTES", "TO_RECEIVER", "TO_SENDER", "LaneCipher",
    "RecordJob", "crypto_workers", "record_spans", "wait_all",
]  # fmt: skip

LANE_KEY_BYTES = 32
"""A sealed lane's AES-256-GCM key, fresh for every offer."""
TAG_BYTES = 16
"""Bytes an AES-GCM record adds to its plaintext (the authentication tag)."""
MAX_ATTEMPT = (1 << 24) - 1
"""Connections one sealed offer may be tried with (the attempt has 24 bits of the nonce)."""
TO_RECEIVER = 0
"""Nonce direction of the records the connecting side (the sender of the data) writes."""
TO_SENDER = 1
"""Nonce direction of the records the accepting side (the receiver) writes: the ack."""


class LaneCipher:
    """AES-256-GCM records of one direction of one lane connection.

    The ``i``-th record sealed (or opened) uses the nonce ``(direction << 24 | attempt, i)``
    (:data:`chaos.wire.LANE_NONCE`); both ends count the records of a direction in the same
    order, so a record that is dropped, reordered or replayed fails to open.

    Args:
        key: The lane key (32 bytes, from the offer).
        attempt: The connection's attempt number for this key (0 to 2**24 - 1).
        direction: :data:`TO_RECEIVER` or :data:`TO_SENDER`.

    Raises:
        ValueError: a key of another size, or an attempt out of range.
    """

    def __init__(self, key: bytes, attempt: int, direction: int) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        if len(key) != LANE_KEY_BYTES:
            raise ValueError(f"a lane key is {LANE_KEY_BYTES} bytes")
        if not 0 <= attempt <= MAX_ATTEMPT:
            raise ValueError(f"lane attempt {attempt} out of range")
        self._aead = AESGCM(key)
        self._prefix = (direction << 24) | attempt
        self._counter = 0
        self._into = hasattr(self._aead, "encrypt_into")

    def next_nonce(self) -> bytes:
        """The next record's nonce (records must be sealed or opened in this order of their
        nonces; :meth:`seal_at` and :meth:`open_at` then run in any thread)."""
        nonce = _NONCE.pack(self._prefix, self._counter)
        self._counter += 1
        return nonce

    def seal(self, data: bytes | memoryview, aad: bytes | None = None) -> bytes:
        """The next record: ``data`` encrypted, with its tag (``len(data) + 16`` bytes)."""
        return self._aead.encrypt(self.next_nonce(), data, aad)

    def seal_at(self, nonce: bytes, data: memoryview, out: memoryview) -> None:
        """Seals ``data`` under ``nonce`` (from :meth:`next_nonce`) into ``out``."""
        if self._into:
            self._aead.encrypt_into(nonce, data, None, out)
        else:  # cryptography < 45: one copy more
            out[:] = self._aead.encrypt(nonce, data, None)

    def open(
        self, record: bytes | bytearray | memoryview, aad: bytes | None = None
    ) -> bytes | None:
        """The plaintext of the next record, or ``None`` when it fails authentication."""
        from cryptography.exceptions import InvalidTag

        try:
            return self._aead.decrypt(self.next_nonce(), record, aad)
        except InvalidTag:
            return None

    def open_at(self, nonce: bytes, record: memoryview, out: memoryview) -> bool:
        """Opens ``record`` sealed under ``nonce`` into ``out``; ``False``: not authentic."""
        from cryptography.exceptions import InvalidTag

        try:
            if self._into:
                self._aead.decrypt_into(nonce, record, None, out)
            else:  # cryptography < 45: one copy more
                out[:] = self._aead.decrypt(nonce, record, None)
        except InvalidTag:
            return False
        return True


class RecordJob:
    """One sealing or opening job run by :class:`_Workers`; :meth:`wait` returns its result."""

    __slots__ = ("_args", "_done", "_error", "_fn", "_result")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self._fn, self._args = fn, args
        self._result: Any = None
        self._error: BaseException | None = None
        self._done = _thread.allocate_lock()
        self._done.acquire()

    def run(self) -> None:
        try:
            self._result = self._fn(*self._args)
        except BaseException as exc:  # handed to the waiter
            self._error = exc
        finally:
            self._done.release()

    def wait(self) -> Any:
        """The job's result (blocks until it ran; it takes microseconds).

        Raises:
            BaseException: what the job raised.
        """
        self._done.acquire()
        self._done.release()
        if self._error is not None:
            raise self._error
        return self._result


class _Workers:
    """A few threads that seal and open lane records beside the threads that write and read
    them (AES-GCM releases the GIL), so that a chunk's crypto overlaps its transfer."""

    def __init__(self, count: int) -> None:
        self._jobs: queue.SimpleQueue[RecordJob] = queue.SimpleQueue()
        for _ in range(count):
            _thread.start_new_thread(self._run, ())

    def _run(self) -> None:
        while True:
            self._jobs.get().run()

    def submit(self, fn: Callable[..., Any], *args: Any) -> RecordJob:
        job = RecordJob(fn, args)
        self._jobs.put(job)
        return job


_workers: _Workers | None = None
_workers_lock = threading.Lock()


def crypto_workers() -> _Workers:
    """The process's record workers (started at the first sealed lane): one, or two from 16
    cores (more only compete with the threads moving the bytes: on a 16-core host with four
    members, four each were slower than two)."""
    global _workers
    with _workers_lock:
        if _workers is None:
            _workers = _Workers(max(1, min(2, (os.cpu_count() or 1) // 8)))
        return _workers


def record_spans(nbytes: int) -> list[tuple[int, int]]:
    """The plaintext ``(start, end)`` of each record of a sealed payload of ``nbytes``."""
    return [(lo, min(nbytes, lo + LANE_RECORD_BYTES))
            for lo in range(0, nbytes, LANE_RECORD_BYTES)] or [(0, 0)]  # fmt: skip


def wait_all(jobs: list[RecordJob]) -> list[Any]:
    """The results of ``jobs``, once all ran (the first error is raised after all ran)."""
    out: list[Any] = []
    error: BaseException | None = None
    for job in jobs:
        try:
            out.append(job.wait())
        except BaseException as exc:  # noqa: BLE001 - re-raised once every job is done
            error = error or exc
    if error is not None:
        raise error
    return out
