"""Append-only JSONL event log.

One JSON object per line: ``{"ts": <unix seconds>, "node": <id>, "event": <name>, ...fields}``.
Lines are flushed as written, so a harness can tail the file while the daemon runs. Event names
are listed in ``docs/daemon.md``.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections import deque
from pathlib import Path
from typing import IO, Any

import msgspec

from chaos.protocol import EventEntry
from chaos.protocol.ids import is_node_id
from chaos.protocol.messages import MAX_ELAPSED_S, MAX_STATUS_EVENTS

log = logging.getLogger("chaos.daemon.events")


class EventLog:
    """Writes events for one node.

    Args:
        path: The JSONL file; created (mode 0600) with its parent directory (mode 0700),
            appended to if it exists. A symlink is refused (``O_NOFOLLOW``): whoever planted it
            would have the daemon write where they chose.
        node_id: The node every event is stamped with.

    Raises:
        OSError: the file cannot be opened, or is a symlink (``ELOOP``, with a clear message).
    """

    def __init__(self, path: str | os.PathLike[str], node_id: str) -> None:
        Path(path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise OSError(
                    exc.errno, f"event log {path} is a symlink; refusing to follow it"
                ) from exc
            raise
        self._fh: IO[bytes] | None = os.fdopen(fd, "ab")
        self._node = node_id
        self._enc = msgspec.json.Encoder()
        self.path = str(path)
        # the last events as logged; shaped for ``status`` only when it is asked (entry_of)
        self._recent: deque[tuple[float, str, dict[str, Any]]] = deque(maxlen=MAX_STATUS_EVENTS)

    def emit(self, event: str, **fields: Any) -> None:
        """Appends one event stamped with the wall-clock time.

        Args:
            event: Event name, e.g. ``"view_installed"``.
            **fields: JSON-serializable details.
        """
        if self._fh is None:
            return
        record = {"ts": time.time(), "node": self._node, "event": event, **fields}
        self._recent.append((record["ts"], event, fields))
        try:
            self._fh.write(self._enc.encode(record) + b"\n")
            self._fh.flush()
        except (OSError, TypeError) as exc:  # never let the log take the daemon down
            log.warning("event log write failed: %s", exc)

    def recent(self) -> list[EventEntry]:
        """The most recent events (at most :data:`MAX_STATUS_EVENTS`), oldest first."""
        return [entry_of(ts, self._node, event, fields) for ts, event, fields in self._recent]

    def close(self) -> None:
        """Closes the file; later events are ignored."""
        if self._fh is not None:
            self._fh.close()
            self._fh = None


_DURATIONS = ("delay_s", "elapsed_s")
_TEXT_MAX = 256


def entry_of(ts: float, node: str, event: str, fields: dict[str, Any]) -> EventEntry:
    """An event as ``status`` shows it: its peer (when it names a valid node id), the duration
    it measured (``delay_s`` or ``elapsed_s``), and its other fields as ``key=value`` text, cut
    to fit the message's bounds.

    Args:
        ts: Unix seconds.
        node: The node that logged it.
        event: Its name.
        fields: Its fields.
    """
    peer = fields.get("peer")
    if not (isinstance(peer, str) and is_node_id(peer)):
        peer = None
    seconds = next((float(fields[k]) for k in _DURATIONS if isinstance(fields.get(k), (int, float))
                    and not isinstance(fields.get(k), bool)
                    and 0.0 <= float(fields[k]) <= MAX_ELAPSED_S), None)  # fmt: skip
    text = " ".join(f"{k}={_short(v)}" for k, v in fields.items() if k != "peer")
    return EventEntry(ts=max(0.0, ts), node=node, event=event[:64], peer=peer,
                      text=text[:_TEXT_MAX], seconds=seconds)  # fmt: skip


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)) and len(value) > 8:
        return f"[{len(value)} items]"
    return str(value)[:80]


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Reads an event log, skipping a torn last line.

    Args:
        path: The JSONL file.

    Returns:
        The events in order.
    """
    out: list[dict[str, Any]] = []
    with open(path, "rb") as fh:
        for line in fh:
            try:
                out.append(msgspec.json.decode(line))
            except msgspec.DecodeError:
                continue
    return out
