"""Launching the local processes of a Chaos cluster: daemons and training workers.

The one place that builds the ``chaos-daemon`` command line (:func:`daemon_command`,
:func:`daemon_cli`), picks free loopback ports (:func:`free_port`, :func:`free_tcp_address`),
starts daemons and workers with the conventions every launcher shares (:func:`spawn_daemon`,
:func:`spawn_worker`), waits for a condition with a deadline (:func:`wait_until`) and kills and
reaps what it started (:func:`kill_and_reap`). The embedded daemon of a
:class:`chaos.trainer.Trainer`, the benchmarks, the emulator, the examples and the tests all
launch through it.

This module never imports torch (the daemon side uses it).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import psutil

from chaos.errors import ChaosError, ChaosTimeout

T = TypeVar("T")

DAEMON_MODULE = "chaos.daemon.cli"
"""The module behind the ``chaos-daemon`` command (run as ``python -m``)."""
RUN_DIR_ENV = "CHAOS_DAEMON_DIR"
"""The environment variable naming a daemon's run directory (IPC socket, event log)."""
LOG_LEVEL_ENV = "CHAOS_DAEMON_LOG_LEVEL"
"""The environment variable setting a daemon's log level."""
DEFAULT_POLL_S = 0.05
DEFAULT_REAP_TIMEOUT_S = 30.0

_PR_SET_PDEATHSIG = 1

PopenFn = Callable[..., "subprocess.Popen[Any]"]
"""Starts a process like :class:`subprocess.Popen` (e.g. inside a network namespace)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free right now.

    Args:
        host: The address to bind.

    Returns:
        The port (another process may take it before the caller binds it).
    """
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_tcp_address(host: str = "127.0.0.1") -> str:
    """A ``tcp://HOST:PORT`` address whose port is free right now.

    Args:
        host: The address to bind.

    Returns:
        The endpoint.
    """
    return f"tcp://{host}:{free_port(host)}"


def daemon_cli(*args: str) -> list[str]:
    """The ``chaos-daemon`` command line with ``args`` (a client command such as ``status``).

    Args:
        *args: The command and its arguments.

    Returns:
        The argv, run by this interpreter.
    """
    return [sys.executable, "-m", DAEMON_MODULE, *args]


def daemon_command(
    node_id: str,
    listen: str,
    *,
    join: str | None = None,
    neighbors: Sequence[str] = (),
    config: str | Path | None = None,
    heartbeat_interval_s: float | None = None,
    failure_timeout_s: float | None = None,
    cluster_key: str | Path | None = None,
    enable_fault_injection: bool = False,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The ``chaos-daemon start`` command line.

    Args:
        node_id: The node id (``--id``).
        listen: The control endpoint to bind, ``tcp://HOST:PORT`` (``--listen``).
        join: A member's endpoint to join through; ``None`` starts a new cluster.
        neighbors: Wanted overlay neighbours (``--neighbor``, repeated).
        config: A TOML file of daemon settings (``--config``).
        heartbeat_interval_s: ``--heartbeat-interval``, if given.
        failure_timeout_s: ``--failure-timeout``, if given.
        cluster_key: The cluster key file (``--cluster-key``), if any.
        enable_fault_injection: Accept the ``fault`` command and ``faults`` presets
            (``--enable-fault-injection``; tests and the harness).
        extra_args: More ``chaos-daemon start`` arguments, passed last.

    Returns:
        The argv, run by this interpreter.

    Raises:
        ValueError: an empty node id or listen endpoint.
    """
    if not node_id or not listen:
        raise ValueError(f"a daemon needs a node id and a listen endpoint, got {node_id!r}, "
                         f"{listen!r}")  # fmt: skip
    argv = daemon_cli("start", "--id", node_id, "--listen", listen)
    if config is not None:
        argv += ["--config", str(config)]
    if heartbeat_interval_s is not None:
        argv += ["--heartbeat-interval", str(heartbeat_interval_s)]
    if failure_timeout_s is not None:
        argv += ["--failure-timeout", str(failure_timeout_s)]
    if cluster_key is not None:
        argv += ["--cluster-key", str(cluster_key)]
    if enable_fault_injection:
        argv.append("--enable-fault-injection")
    if join is not None:
        argv += ["--join", join]
    for n in neighbors:
        argv += ["--neighbor", n]
    return [*argv, *extra_args]


def daemon_env(
    run_dir: str | Path, log_level: str | None = None, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment of a daemon process or of a client command for it.

    Args:
        run_dir: The daemon's run directory.
        log_level: Its log level (e.g. ``"WARNING"``); ``None`` keeps the inherited one.
        base: The environment to extend (default: this process's).

    Returns:
        A new environment mapping.
    """
    env = dict(os.environ if base is None else base)
    env[RUN_DIR_ENV] = str(run_dir)
    if log_level is not None:
        env[LOG_LEVEL_ENV] = log_level
    return env


def _follow_training_process() -> None:
    """In an embedded daemon's child, before exec: its lifecycle follows its training process.

    * Ctrl+C in a terminal sends SIGINT to the whole foreground process group, and a service
      manager or ``kill -TERM -PGID`` sends SIGTERM to it: the daemon gets them too. It ignores
      both (``chaos-daemon start`` keeps an ignored signal ignored). The script sees them, and
      its ``request_node_exit()`` makes the daemon leave at a step boundary. Had the daemon
      left on its own, it would have left under a trainer still in its step, and the script's
      leave request would have found no daemon to answer it.
    * SIGHUP (a graceful leave) when the training process dies: if it crashes, the daemon leaves
      the cluster rather than lingering as a member with no trainer. Linux only; a no-op
      elsewhere. The embedded daemon's ``stop()`` sends SIGHUP too.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # SIGHUP is this daemon's own leave signal: a script run under nohup (SIGHUP ignored, and
    # inherited) must not leave its daemon deaf to stop() and to the script's death
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    _on_parent_death(signal.SIGHUP)


def _on_parent_death(sig: int) -> None:
    """Asks the kernel to send ``sig`` to this process when its parent dies (Linux only)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)


def _term_on_parent_death() -> None:
    """In a worker, before exec: SIGTERM (a graceful leave) when the launcher dies."""
    _on_parent_death(signal.SIGTERM)


def spawn_daemon(
    command: Sequence[str],
    run_dir: str | Path,
    *,
    log_path: str | Path | None = None,
    log_level: str | None = None,
    follow_parent: bool = False,
) -> subprocess.Popen[bytes]:
    """Starts a ``chaos-daemon start`` process (see :func:`daemon_command`).

    Its run directory is created private (mode 0700; an existing one of this user is made so,
    as the daemon refuses a run directory others can enter) and passed in :data:`RUN_DIR_ENV`;
    its stdout and stderr are appended to ``log_path``.

    Args:
        command: The daemon's argv.
        run_dir: Its run directory (IPC socket, event log).
        log_path: Where its output goes (default: ``RUN_DIR/daemon.log``).
        log_level: :data:`LOG_LEVEL_ENV`, if given.
        follow_parent: An embedded daemon: it ignores SIGINT and SIGTERM (sent to the training
            process's group) and gets SIGHUP, a graceful leave, when its parent dies.

    Returns:
        The process; the caller stops and reaps it (e.g. :func:`kill_and_reap`).
    """
    private_dir(run_dir)
    log = Path(log_path) if log_path is not None else Path(run_dir) / "daemon.log"
    with log.open("ab") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            list(command),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=daemon_env(run_dir, log_level),
            preexec_fn=_follow_training_process if follow_parent else None,
        )


def private_dir(path: str | Path) -> Path:
    """Creates ``path`` with mode 0700, or makes an existing directory of this user 0700.

    Args:
        path: The directory (a daemon's run directory).

    Returns:
        It.

    Raises:
        OSError: it cannot be created.
    """
    p = Path(path)
    p.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = p.stat()
    if st.st_uid == os.geteuid() and st.st_mode & 0o077:
        p.chmod(0o700)
    return p


def spawn_worker(
    argv: Sequence[str],
    *,
    log_path: str | Path | None,
    env: Mapping[str, str] | None = None,
    append: bool = True,
    term_on_parent_death: bool = False,
    popen: PopenFn = subprocess.Popen,
) -> subprocess.Popen[Any]:
    """Starts a training worker (or another helper process) in its own session.

    The worker leads a new process group, so its embedded daemon (its child) is in it and
    ``kill_and_reap(..., group=True)`` takes both.

    Args:
        argv: The worker's command line.
        log_path: File its stdout and stderr go to; ``None``: a text pipe
            (``proc.stdout``) the caller reads.
        env: Variables added to this process's environment.
        append: Append to ``log_path`` (else truncate it).
        term_on_parent_death: SIGTERM (a graceful leave) to the worker when this process dies
            (Linux only).
        popen: Starts the process (default :class:`subprocess.Popen`; e.g. one that runs it in
            a network namespace).

    Returns:
        The process; the caller stops and reaps it.
    """
    kwargs: dict[str, Any] = {
        "env": {**os.environ, **(env or {})},
        "start_new_session": True,
        "stderr": subprocess.STDOUT,
    }
    if term_on_parent_death:
        kwargs["preexec_fn"] = _term_on_parent_death
    if log_path is None:
        return popen(list(argv), stdout=subprocess.PIPE, text=True, **kwargs)
    with Path(log_path).open("ab" if append else "wb") as out:  # the child keeps its own
        return popen(list(argv), stdout=out, **kwargs)


def signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    """Sends ``sig`` to the process group ``proc`` leads (see :func:`spawn_worker`).

    A group that is gone already, or one not ours to signal, is passed over.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def kill_and_reap(
    procs: Iterable[subprocess.Popen[Any]],
    *,
    group: bool = False,
    timeout_s: float = DEFAULT_REAP_TIMEOUT_S,
) -> None:
    """SIGKILLs every process (or its whole process group) and reaps them all.

    Safe to call when they exited already, and more than once.

    Args:
        procs: The processes.
        group: Kill each one's process group (workers from :func:`spawn_worker`, whose
            embedded daemon may outlive them), not just the process.
        timeout_s: Longest wait for each one to be reaped.

    Raises:
        ChaosTimeout: a process was not reaped within ``timeout_s`` (SIGKILL cannot be
            ignored, so only a process stuck in the kernel).
    """
    procs = list(procs)
    for p in procs:
        if group:
            signal_group(p, signal.SIGKILL)
        elif p.poll() is None:
            p.kill()
    stuck = []
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stuck.append(p.pid)
    if stuck:
        raise ChaosTimeout(f"processes {stuck} not reaped {timeout_s:g} s after SIGKILL")


def stop_tree(
    proc: subprocess.Popen[Any],
    sig: int = signal.SIGKILL,
    grace_s: float = DEFAULT_REAP_TIMEOUT_S,
    timeout_s: float = 10.0,
) -> None:
    """Stops a launcher that is still running, and every process it started, and reaps them.

    Its descendants are listed first; it gets ``sig`` (SIGTERM lets a launcher reap its own
    workers) and ``grace_s`` to exit, then SIGKILL; then each descendant still there is killed.
    A launcher that exited already is left alone.

    Args:
        proc: The launcher.
        sig: The first signal it gets.
        grace_s: How long it may take to exit after ``sig``.
        timeout_s: Longest wait for each process to be reaped after SIGKILL.
    """
    if proc.poll() is not None:
        return
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    proc.send_signal(sig)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)
    for p in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
            p.wait(timeout=timeout_s)


class ProcessExited(ChaosError):
    """A watched process exited with a failing code while :func:`wait_until` waited.

    Attributes:
        name: The process's name (its key in ``watch``).
        code: Its exit code.
    """

    def __init__(self, name: str, code: int) -> None:
        super().__init__(f"{name} exited with code {code}")
        self.name = name
        self.code = code


def _first_failure(
    procs: Mapping[str, subprocess.Popen[Any]], ok: Sequence[int]
) -> tuple[str, int] | None:
    """The first process of ``procs`` that exited with a code not in ``ok``, if any."""
    for name, p in procs.items():
        code = p.poll()
        if code is not None and code not in ok:
            return name, code
    return None


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float,
    what: str,
    *,
    poll_s: float = DEFAULT_POLL_S,
    tolerate: tuple[type[BaseException], ...] = (),
    watch: Mapping[str, subprocess.Popen[Any]] | None = None,
    ok: Sequence[int] = (0,),
) -> T:
    """Polls ``predicate`` until it returns a truthy value.

    Args:
        predicate: The condition; it may raise to give up early (e.g. a worker crashed).
        timeout_s: The deadline, in seconds from now.
        what: What is awaited, for the error message.
        poll_s: Sleep between two polls.
        tolerate: Exceptions from ``predicate`` that count as "not yet" (e.g. a daemon that
            does not answer yet).
        watch: Processes by name (workers) whose failure ends the wait early.
        ok: Exit codes of a watched process that are not a failure.

    Returns:
        The predicate's first truthy value.

    Raises:
        ChaosTimeout: (a :class:`TimeoutError`) it did not hold within ``timeout_s``; the
            message names ``what`` and the last value or tolerated error.
        ProcessExited: a watched process exited with a code not in ``ok`` (checked after each
            poll that did not hold).
        ValueError: a negative ``timeout_s`` or a non-positive ``poll_s``.
    """
    if timeout_s < 0 or not poll_s > 0:
        raise ValueError(f"bad timeout_s {timeout_s!r} or poll_s {poll_s!r}")
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        try:
            result = predicate()
        except tolerate as exc:
            last = exc
        else:
            if result:
                return result
            last = result
        failed = _first_failure(watch, ok) if watch is not None else None
        if failed is not None:
            raise ProcessExited(*failed)
        left = deadline - time.monotonic()
        if left <= 0:
            raise ChaosTimeout(
                f"timed out after {timeout_s:g} s waiting for {what} (last: {last!r})"
            )
        time.sleep(min(poll_s, left))


__all__ = [
    "ProcessExited",
    "DAEMON_MODULE",
    "LOG_LEVEL_ENV",
    "RUN_DIR_ENV",
    "daemon_cli",
    "daemon_command",
    "daemon_env",
    "free_port",
    "free_tcp_address",
    "kill_and_reap",
    "private_dir",
    "signal_group",
    "spawn_daemon",
    "spawn_worker",
    "stop_tree",
    "wait_until",
]
