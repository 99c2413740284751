"""chaos.launch: free ports, the daemon command line, and real daemon and worker processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from chaos.errors import ChaosError, ChaosTimeout
from chaos.launch import (
    LOG_LEVEL_ENV,
    RUN_DIR_ENV,
    ProcessExited,
    daemon_cli,
    daemon_command,
    daemon_env,
    free_port,
    free_tcp_address,
    kill_and_reap,
    private_dir,
    signal_group,
    spawn_daemon,
    spawn_worker,
    stop_tree,
    wait_until,
)

DEADLINE_S = 60.0


def test_a_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    address = free_tcp_address()
    host, _, port_text = address.removeprefix("tcp://").rpartition(":")
    assert address.startswith("tcp://") and host == "127.0.0.1" and int(port_text) > 0


def test_the_daemon_command_line_from_typed_arguments(tmp_path: Path) -> None:
    argv = daemon_command(
        "n2",
        "tcp://127.0.0.1:7001",
        join="tcp://127.0.0.1:7000",
        neighbors=("n1", "n3"),
        config=tmp_path / "d.toml",
        heartbeat_interval_s=0.1,
        failure_timeout_s=0.5,
        extra_args=("--replication-strategy", "even"),
    )
    assert argv[:3] == [sys.executable, "-m", "chaos.daemon.cli"]
    assert argv[3:] == [
        "start", "--id", "n2", "--listen", "tcp://127.0.0.1:7001",
        "--config", str(tmp_path / "d.toml"), "--heartbeat-interval", "0.1",
        "--failure-timeout", "0.5", "--join", "tcp://127.0.0.1:7000",
        "--neighbor", "n1", "--neighbor", "n3", "--replication-strategy", "even",
    ]  # fmt: skip
    assert daemon_command("a", "tcp://127.0.0.1:1")[3:] == [
        "start", "--id", "a", "--listen", "tcp://127.0.0.1:1",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="node id"):
        daemon_command("", "tcp://127.0.0.1:1")
    keyed = daemon_command(
        "a", "tcp://127.0.0.1:1", cluster_key=tmp_path / "k", enable_fault_injection=True
    )
    assert keyed[3:] == [
        "start", "--id", "a", "--listen", "tcp://127.0.0.1:1",
        "--cluster-key", str(tmp_path / "k"), "--enable-fault-injection",
    ]  # fmt: skip


def test_a_daemon_run_directory_is_made_private(tmp_path: Path) -> None:
    fresh = private_dir(tmp_path / "new" / "run")
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    assert stat.S_IMODE(private_dir(shared).stat().st_mode) == 0o700


def test_the_daemon_environment_names_its_run_directory(tmp_path: Path) -> None:
    env = daemon_env(tmp_path, "ERROR", base={"KEEP": "1"})
    assert env == {"KEEP": "1", RUN_DIR_ENV: str(tmp_path), LOG_LEVEL_ENV: "ERROR"}
    assert LOG_LEVEL_ENV not in daemon_env(tmp_path, base={})


def _status(run_dir: Path) -> dict[str, object] | None:
    res = subprocess.run(daemon_cli("status", "--json"), env=daemon_env(run_dir),
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    return json.loads(res.stdout) if res.returncode == 0 else None


def test_a_spawned_daemon_answers_status_and_is_reaped(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    argv = daemon_command("solo", free_tcp_address(), heartbeat_interval_s=0.1,
                          failure_timeout_s=0.5)  # fmt: skip
    proc = spawn_daemon(argv, run_dir, log_level="WARNING")
    try:
        assert run_dir.is_dir()
        status = wait_until(lambda: _status(run_dir), DEADLINE_S, "the daemon's status",
                            watch={"solo": proc})  # fmt: skip
        assert [n["id"] for n in status["nodes"]] == ["solo"]  # type: ignore[index,union-attr]
        assert (run_dir / "daemon.log").exists()
        proc.send_signal(signal.SIGTERM)  # a graceful leave
        assert proc.wait(timeout=DEADLINE_S) == 0
    finally:
        kill_and_reap([proc], timeout_s=10.0)
    assert proc.returncode == 0 and not psutil.pid_exists(proc.pid)  # reaped: no zombie left


def test_an_embedded_style_daemon_ignores_sigterm_and_leaves_on_sighup(tmp_path: Path) -> None:
    argv = daemon_command("emb", free_tcp_address())
    proc = spawn_daemon(argv, tmp_path, log_path=tmp_path / "own.log", follow_parent=True)
    try:
        wait_until(lambda: _status(tmp_path), DEADLINE_S, "the daemon's status",
                   watch={"emb": proc})  # fmt: skip
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # long enough for a leave to start; it must not
        assert proc.poll() is None
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=DEADLINE_S) == 0
        assert (tmp_path / "own.log").exists() and not (tmp_path / "daemon.log").exists()
    finally:
        kill_and_reap([proc], timeout_s=10.0)


def test_a_worker_leads_its_group_and_is_reaped_with_its_children(tmp_path: Path) -> None:
    """The worker's child (as an embedded daemon would be) goes with the group kill."""
    code = (
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print(os.environ['MARK'], child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    log = tmp_path / "w.log"
    proc = spawn_worker([sys.executable, "-c", code], log_path=log, env={"MARK": "x"})
    try:
        assert os.getpgid(proc.pid) == proc.pid
        text = wait_until(lambda: log.read_text().strip(), DEADLINE_S, "the child's pid")
        mark, pid = text.split()
        assert mark == "x"  # the given variable, on top of this process's environment
        child = psutil.Process(int(pid))
    finally:
        kill_and_reap([proc], group=True, timeout_s=10.0)
    assert proc.returncode == -signal.SIGKILL
    wait_until(lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE,
               DEADLINE_S, "the child to die")  # fmt: skip
    kill_and_reap([proc], group=True, timeout_s=1.0)  # twice is harmless
    signal_group(proc, signal.SIGKILL)  # a gone group is passed over


def test_a_worker_without_a_log_gives_a_text_pipe() -> None:
    proc = spawn_worker([sys.executable, "-c", "print('hello')"], log_path=None)
    try:
        out, _ = proc.communicate(timeout=DEADLINE_S)
    finally:
        kill_and_reap([proc], timeout_s=10.0)
    assert out == "hello\n"


def test_a_truncated_worker_log_starts_empty(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_text("old\n")
    proc = spawn_worker([sys.executable, "-c", "print('new')"], log_path=log, append=False)
    assert proc.wait(timeout=DEADLINE_S) == 0
    assert log.read_text() == "new\n"


def test_wait_until_returns_the_first_truthy_value() -> None:
    calls = iter([0, None, [], 7, 8])
    assert wait_until(lambda: next(calls), 10.0, "a number", poll_s=0.001) == 7


def test_wait_until_times_out_with_a_timeout_error() -> None:
    t0 = time.monotonic()
    with pytest.raises(ChaosTimeout, match=r"after 0.2 s waiting for the moon \(last: False\)"):
        wait_until(lambda: False, 0.2, "the moon", poll_s=0.01)
    assert time.monotonic() - t0 < 5.0
    with pytest.raises(TimeoutError):  # the built-in catches it too
        wait_until(lambda: None, 0.0, "nothing")


def test_wait_until_tolerates_only_the_errors_it_is_given() -> None:
    def refuse() -> bool:
        raise ChaosError("not yet")

    with pytest.raises(ChaosTimeout, match="not yet"):
        wait_until(refuse, 0.1, "a daemon", poll_s=0.01, tolerate=(ChaosError,))
    with pytest.raises(ChaosError, match="not yet"):  # anything else ends the wait at once
        wait_until(refuse, 10.0, "a daemon")
    with pytest.raises(ValueError):
        wait_until(lambda: True, -1.0, "x")


def test_launch_does_not_import_torch() -> None:
    code = (
        "import sys, chaos.launch\n"
        "print(sum(m == 'torch' or m.startswith('torch.') for m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"


def test_wait_until_gives_up_when_a_watched_process_fails() -> None:
    proc = spawn_worker([sys.executable, "-c", "raise SystemExit(3)"], log_path=None)
    fine = spawn_worker([sys.executable, "-c", "pass"], log_path=None)
    try:
        fine.wait(timeout=DEADLINE_S)
        with pytest.raises(ProcessExited, match="bad exited with code 3") as info:
            wait_until(lambda: False, DEADLINE_S, "never", watch={"ok": fine, "bad": proc})
        assert (info.value.name, info.value.code) == ("bad", 3)
        assert wait_until(lambda: 1, 1.0, "x", watch={"bad": proc}) == 1  # polled first
        with pytest.raises(ChaosTimeout):  # an allowed exit code is no failure
            wait_until(lambda: False, 0.2, "x", watch={"bad": proc}, ok=(3,))
    finally:
        kill_and_reap([proc, fine], timeout_s=10.0)


def test_stop_tree_reaps_a_launcher_and_what_it_started(tmp_path: Path) -> None:
    code = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],\n"
        "                         start_new_session=True)\n"  # out of the launcher's group
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    log = tmp_path / "l.log"
    proc = spawn_worker([sys.executable, "-c", code], log_path=log)
    try:
        pid = int(wait_until(lambda: log.read_text().strip(), DEADLINE_S, "the child's pid"))
        stop_tree(proc, signal.SIGTERM, grace_s=10.0)
    finally:
        kill_and_reap([proc], group=True, timeout_s=10.0)
    assert proc.returncode == -signal.SIGTERM
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    stop_tree(proc)  # an exited launcher is left alone
