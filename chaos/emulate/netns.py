"""Low-level helpers: running ``ip``/``tc`` with timeouts, and sockets inside a network namespace.

Everything here needs root (``CAP_NET_ADMIN`` and ``CAP_SYS_ADMIN``); :func:`require_root` says so
clearly before anything is touched.

:func:`netns_socket` creates a socket *inside* a named namespace from this process: the calling
thread enters the namespace with ``setns(2)``, creates the socket and switches back. A socket stays
in the namespace it was created in, so one process can measure traffic between two namespaces
without spawning helpers (no iperf3 or ping needed).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import subprocess
from collections.abc import Iterator, Sequence

from chaos.errors import ChaosError, ChaosTimeout

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/var/run/netns"
DEFAULT_COMMAND_TIMEOUT_S = 10.0


class NetworkSetupError(ChaosError):
    """An ``ip``/``tc`` command failed, or the network is used in a way it does not support."""


class RootRequiredError(NetworkSetupError, PermissionError):
    """The emulated network needs root (network namespaces, veth pairs, tc)."""


def require_root() -> None:
    """Raises :class:`RootRequiredError` unless this process runs as root.

    Raises:
        RootRequiredError: the effective user id is not 0.
    """
    if os.geteuid() != 0:
        raise RootRequiredError(
            "the emulated network needs root: it creates network namespaces, veth pairs and tc "
            "qdiscs (run as root, e.g. with sudo)"
        )


def run_cmd(
    argv: Sequence[str],
    *,
    timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S,
    check: bool = True,
    stdin: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Runs a command to completion and returns its result.

    Args:
        argv: The command and its arguments.
        timeout_s: Seconds before the command is killed.
        check: Raise on a non-zero exit status.
        stdin: Text fed to the command's standard input.

    Returns:
        The completed process, with text stdout and stderr.

    Raises:
        ChaosTimeout: the command ran past ``timeout_s``.
        NetworkSetupError: ``check`` is set and the command failed (the message quotes stderr),
            or the program does not exist.
    """
    try:
        res = subprocess.run(
            list(argv), input=stdin, capture_output=True, text=True, timeout=timeout_s,
            check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired as e:
        raise ChaosTimeout(f"{' '.join(argv)!r} did not finish within {timeout_s} s") from e
    except FileNotFoundError as e:
        raise NetworkSetupError(f"program not found: {argv[0]!r}") from e
    if check and res.returncode != 0:
        raise NetworkSetupError(
            f"{' '.join(argv)!r} failed (exit {res.returncode}): {res.stderr.strip()}"
        )
    return res


def ip_batch(ns: str | None, commands: Sequence[str], *, timeout_s: float) -> None:
    """Runs many ``ip`` commands in one process (``ip -batch -``), inside namespace ``ns``.

    Args:
        ns: The namespace (``None``: this process's namespace).
        commands: ``ip`` commands without the leading ``ip`` (e.g. ``"route replace ..."``).
        timeout_s: Seconds before the batch is killed.

    Raises:
        ChaosTimeout: the batch ran past ``timeout_s``.
        NetworkSetupError: a command in the batch failed.
    """
    if not commands:
        return
    argv = ["ip"] + (["-n", ns] if ns else []) + ["-batch", "-"]
    run_cmd(argv, stdin="\n".join(commands) + "\n", timeout_s=timeout_s)


def list_namespaces(timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S) -> list[str]:
    """Returns the names of all named network namespaces (``ip netns list``).

    Raises:
        ChaosTimeout: ``ip`` hung.
        NetworkSetupError: ``ip`` failed.
    """
    out = run_cmd(["ip", "netns", "list"], timeout_s=timeout_s).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_pids(ns: str, timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S) -> list[int]:
    """Returns the ids of the processes running inside namespace ``ns`` (empty if it is gone).

    Raises:
        ChaosTimeout: ``ip`` hung.
    """
    res = run_cmd(["ip", "netns", "pids", ns], timeout_s=timeout_s, check=False)
    return [int(p) for p in res.stdout.split() if p.strip().isdigit()]


_libc: ctypes.CDLL | None = None


def _setns(fd: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns failed: {os.strerror(err)}")


@contextlib.contextmanager
def in_netns(ns: str) -> Iterator[None]:
    """Runs the ``with`` body's calling thread inside network namespace ``ns``.

    Only this thread switches (a network namespace is per thread); it switches back on exit.
    Sockets created in the body stay in ``ns`` for their whole life.

    Raises:
        NetworkSetupError: the namespace does not exist or setns failed.
    """
    try:
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    except OSError as e:
        raise NetworkSetupError(f"cannot open this thread's network namespace: {e}") from e
    try:
        try:
            target = os.open(os.path.join(NETNS_DIR, ns), os.O_RDONLY)
        except OSError as e:
            raise NetworkSetupError(f"no network namespace {ns!r}: {e}") from e
        try:
            _setns(target)
        except OSError as e:
            raise NetworkSetupError(f"cannot enter namespace {ns!r}: {e}") from e
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)


def netns_socket(ns: str, kind: socket.SocketKind = socket.SOCK_STREAM) -> socket.socket:
    """Creates an IPv4 socket inside namespace ``ns``.

    Args:
        ns: The namespace's name.
        kind: ``socket.SOCK_STREAM`` (TCP) or ``socket.SOCK_DGRAM`` (UDP).

    Returns:
        The socket; the caller closes it.

    Raises:
        NetworkSetupError: the namespace does not exist or cannot be entered.
    """
    with in_netns(ns):
        return socket.socket(socket.AF_INET, kind)
