"""The exit event of a training script: Ctrl+C, SIGTERM or a user's quit signal.

``capture_exit_event()`` (re-exported by :mod:`chaos.trainer`, where scripts import it) turns
SIGINT and SIGTERM into a flag the script checks at each step boundary, so that it leaves with
``Trainer.request_node_exit()`` instead of dying in the middle of a step. A ``Trainer``'s embedded
daemon ignores both signals (see :mod:`chaos.trainer.embedded`): only the script reacts to them.
"""

from __future__ import annotations

import signal
import threading

__all__ = ["capture_exit_event", "install_exit_handlers", "request_exit"]

_EXIT = threading.Event()
_HANDLERS_INSTALLED = False


def _on_signal(signum: int, frame: object) -> None:
    _EXIT.set()


def install_exit_handlers() -> None:
    """Makes SIGINT and SIGTERM set the exit event instead of killing the script."""
    global _HANDLERS_INSTALLED
    if _HANDLERS_INSTALLED or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    _HANDLERS_INSTALLED = True


def capture_exit_event() -> bool:
    """True once Ctrl+C, SIGTERM or :func:`request_exit` asked this script to leave."""
    install_exit_handlers()
    return _EXIT.is_set()


def request_exit() -> None:
    """The user quit signal: makes :func:`capture_exit_event` return True."""
    _EXIT.set()
