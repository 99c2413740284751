"""Keeps glibc's allocator from handing every received frame's memory back to the kernel.

ZeroMQ's I/O thread allocates one buffer per received frame (``chunk_bytes``, 1-2 MiB) and frees
it once the allreduce has consumed the frame. With glibc's defaults, a freed block of that size
either was its own ``mmap`` (unmapped at once) or sits at the top of a heap whose free tail
exceeds the trim threshold (given back with ``madvise``/``munmap``). Either way the next frame's
buffer is fresh memory, and the kernel zeroes every page on first touch: ``perf`` shows
``clear_page`` and page faults in the I/O thread at about 8% of an allreduce's CPU on loopback.

:func:`keep_frame_memory` raises the thresholds once per process so that those buffers are reused
instead. It changes the allocator for the whole process: freed memory up to the thresholds stays
mapped. Two kinds of process call it:

* a training process, where a :class:`~chaos.collectives.Communicator` receives gradient frames
  (:class:`~chaos.collectives.CommunicatorConfig` ``keep_frame_memory=False`` leaves the
  allocator alone);
* a daemon, which receives a new link's bandwidth probe as ``bandwidth_probe_chunk_bytes``
  frames (:class:`~chaos.daemon.config.DaemonConfig` ``keep_probe_memory=False`` leaves it
  alone).

It imports neither torch nor ZeroMQ, so that the daemon can use it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
import threading

log = logging.getLogger("chaos.collectives")

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20
"""glibc refuses an mmap threshold above ``HEAP_MAX_SIZE / 2`` (32 MiB on 64-bit)."""

_lock = threading.Lock()
_applied: int | None = None


def keep_frame_memory(chunk_bytes: int) -> bool:
    """Makes glibc keep freed buffers of up to ``chunk_bytes`` mapped for reuse.

    Sets ``M_MMAP_THRESHOLD`` to at least twice ``chunk_bytes`` (at most 32 MiB), so frame
    buffers come from the heap, and ``M_TRIM_THRESHOLD``/``M_TOP_PAD`` so that a heap's free tail
    of up to 64 chunks (at least 256 MiB) is not given back. Idempotent; a later call with larger
    chunks raises the thresholds further.

    Args:
        chunk_bytes: The largest frame payload the process receives.

    Returns:
        ``True`` if the thresholds are set (now or before), ``False`` where the C library is not
        glibc or refused them (nothing is changed then).

    Raises:
        ValueError: ``chunk_bytes`` is not positive.
    """
    global _applied
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be > 0")
    if not sys.platform.startswith("linux"):
        return False
    with _lock:
        if _applied is not None and _applied >= chunk_bytes:
            return True
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):
            return False
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        mmap_threshold = min(_MMAP_THRESHOLD_MAX, max(2 * chunk_bytes, 1 << 20))
        keep = max(64 * chunk_bytes, 256 << 20)
        ok = (
            mallopt(_M_MMAP_THRESHOLD, mmap_threshold) == 1
            and mallopt(_M_TRIM_THRESHOLD, keep) == 1
            and mallopt(_M_TOP_PAD, 16 << 20) == 1
        )
        if not ok:
            log.debug("mallopt refused the frame-memory thresholds; allocator left as it was")
            return False
        _applied = chunk_bytes
        return True
