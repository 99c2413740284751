"""The embedded daemon: a `chaos-daemon` child process started by a Trainer.

When no daemon runs on the device, ``Trainer(...)`` starts one so that a single script works
with no other setup. The child runs the real ``chaos-daemon start`` command in its own run
directory; the trainer talks to it over its IPC endpoint like to any other local daemon.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from chaos.daemon.config import ipc_endpoint_for
from chaos.errors import ChaosError, ChaosTimeout
from chaos.launch import daemon_command, spawn_daemon

if TYPE_CHECKING:
    from chaos.protocol import StatusReply

EXIT_GRACE_S = 5.0
"""How long past its join deadline the readiness wait allows a daemon that gives its join up
to exit (it checks the deadline at every housekeeping tick, then logs why and exits), so that
the error raised is the daemon's own."""
STATUS_TIMEOUT_S = 2.0
"""One status request of the readiness wait (a busy daemon answers late; the wait asks again)."""


def _describe(st: StatusReply, node_id: str, join: str | None) -> str:
    """Where a daemon that is not ready yet stands, from its status."""
    where = f"joining through {join}" if join else "starting a new cluster"
    member = any(n.id == node_id for n in st.nodes)
    parts = [f"it was {where}, in state {st.state}",
             "a member" if member else "not a member yet",
             f"scheduler {st.scheduler}" if st.scheduler else "no scheduler known"]  # fmt: skip
    return ", ".join(parts)


class DaemonStartError(ChaosError):
    """The embedded daemon exited or refused to start (bad arguments, join refused)."""


class EmbeddedDaemon:
    """A ``chaos-daemon start`` child process and its run directory.

    Args:
        node_id: The node id.
        listen: The daemon's control endpoint (``tcp://HOST:PORT``).
        join: A member's endpoint to join through, or ``None`` to start a new cluster.
        extra_args: More ``chaos-daemon start`` arguments (e.g. ``--heartbeat-interval 0.2``).
        run_dir: Run directory (IPC socket, event log); a fresh temporary one by default, which
            :meth:`stop` removes once the daemon has left cleanly (exit code 0) and keeps, with
            the daemon's log, otherwise.
        cluster_key: The cluster key file the daemon starts with (``--cluster-key``); ``None``:
            none (the daemon then listens on loopback only).
    """

    def __init__(
        self,
        node_id: str,
        listen: str,
        join: str | None,
        extra_args: Sequence[str] = (),
        run_dir: str | None = None,
        cluster_key: str | None = None,
    ) -> None:
        self.node_id = node_id
        self.listen = listen
        self.join = join
        self.progress = "not started"
        """Where the readiness wait last saw the daemon (its phase and state)."""
        self._temporary = run_dir is None
        self.run_dir = run_dir or tempfile.mkdtemp(prefix=f"chaos-{node_id}-")
        Path(self.run_dir).mkdir(parents=True, exist_ok=True)
        self.endpoint = ipc_endpoint_for(self.run_dir)
        self.log_path = Path(self.run_dir) / "daemon.log"
        # it ignores SIGINT/SIGTERM and leaves on its parent's death (chaos.launch)
        if cluster_key is not None:
            extra_args = [*extra_args, "--cluster-key", os.fspath(cluster_key)]
        self.proc = spawn_daemon(
            daemon_command(node_id, listen, join=join, extra_args=extra_args),
            self.run_dir,
            log_path=self.log_path,
            follow_parent=True,
        )

    def exited(self) -> bool:
        """Whether the daemon process has exited (after a leave, or killed)."""
        return self.proc.poll() is not None

    def kill(self) -> None:
        """``kill -9`` of the daemon (fault injection: the whole device fails at once)."""
        if self.proc.poll() is None:
            self.proc.kill()

    def log_tail(self, lines: int = 20) -> str:
        """The last lines the daemon printed."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float) -> None:
        """Waits until the daemon's IPC endpoint answers and it is a cluster member with a
        scheduler, following its progress (:attr:`progress`).

        Two phases, each bounded by ``timeout_s`` (the daemon's join timeout, which the
        trainer passes it): its process starting until its IPC endpoint first answers (a busy
        device imports slowly), then its join, counted from that first answer as the daemon
        counts its own join deadline, plus :data:`EXIT_GRACE_S` for a daemon that gives its
        join up to be seen exiting. So a join that cannot complete ends in the daemon's own
        error (its log names why), not in a wait that gave up first.

        Raises:
            DaemonStartError: the daemon exited (bad arguments, join refused or timed out).
            ChaosTimeout: it did not become ready in time; the message names the phase and
                the state it was last seen in.
        """
        started = time.monotonic()
        deadline = started + timeout_s
        answered = False
        self.progress = "its process had not answered on its IPC endpoint yet"
        while (now := time.monotonic()) < deadline:
            if self.proc.poll() is not None:
                raise DaemonStartError(
                    f"embedded daemon {self.node_id} exited with code {self.proc.returncode} "
                    f"({self.progress}):\n" + self.log_tail()
                )
            st = self._status()
            if st is not None:
                if not answered:  # its join started: the daemon's own deadline counts now
                    answered = True
                    deadline = now + timeout_s + EXIT_GRACE_S
                if any(n.id == self.node_id for n in st.nodes) and st.scheduler:
                    return
                self.progress = _describe(st, self.node_id, self.join)
            time.sleep(0.05)
        raise ChaosTimeout(
            f"embedded daemon {self.node_id} not ready within {now - started:.1f} s: "
            f"{self.progress}\n{self.log_tail()}"
        )

    def _status(self) -> StatusReply | None:
        """The daemon's status, or ``None`` while its IPC endpoint does not answer."""
        from chaos.daemon.client import DaemonClient

        if not os.path.exists(self.endpoint[len("ipc://") :]):
            return None
        try:
            with DaemonClient(self.endpoint, timeout_s=STATUS_TIMEOUT_S) as c:
                return c.status()
        except ChaosError:
            return None

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """Stops the daemon (SIGHUP: a graceful leave; SIGKILL after ``timeout_s``).

        Returns:
            Its exit code.
        """
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGHUP)  # it ignores SIGINT and SIGTERM
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._temporary and self.proc.returncode == 0:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            self._temporary = False
        return self.proc.returncode

    def wait_exit(self, timeout_s: float) -> int | None:
        """Waits for the daemon to exit on its own (after a leave); kills it at the deadline."""
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return self.stop(timeout_s=2.0)
        return self.proc.returncode
