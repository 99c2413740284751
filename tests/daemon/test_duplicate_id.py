"""A daemon started under the id of a current member: real daemons on loopback.

A join under the id of a member the scheduler still hears from (or has not yet found failed) at
another address is refused with ``duplicate_id``, and the new daemon exits (code 3). The cluster
commits no epoch for it (no restart storm) and keeps serving ``status``; a killed member is then
detected and removed as any failed member is. A daemon restarted at the member's own address
before its death was detected replaces it: the old incarnation (and its trainer registration) is
dropped and the new one admitted, in a bounded number of commits.
"""

from __future__ import annotations

import signal
import subprocess
from typing import Any

from chaos.daemon.events import read_events
from daemon_helpers import FT_S, HB_S, Cluster, Node, wait_until

from chaos.launch import daemon_command, free_port, spawn_daemon

EXIT_REFUSED = 3
SLOW_FT_S = 4.0


def _commits(node: Node) -> list[dict[str, Any]]:
    return [e for e in node.events() if e["event"] == "committed"]


def _spawn_duplicate(
    cluster: Cluster, of: str, via: Node, port: int | None = None
) -> subprocess.Popen[bytes]:
    """Starts a bare daemon under the id ``of`` (its own run dir; a new port unless ``port``),
    joining via ``via``."""
    run_dir = cluster.tmp / f"dup-{of}"
    argv = daemon_command(
        of,
        f"tcp://127.0.0.1:{port or free_port()}",
        join=via.address,
        neighbors=(via.id,),
        config=cluster.config,
        heartbeat_interval_s=HB_S,
        failure_timeout_s=FT_S,
    )
    proc = spawn_daemon(argv, run_dir, log_path=run_dir / "stderr.log", log_level="WARNING")
    cluster.procs.append(proc)
    return proc


def _dup_events(cluster: Cluster, of: str) -> list[dict[str, Any]]:
    path = cluster.tmp / f"dup-{of}" / f"events-{of}.jsonl"
    return list(read_events(path)) if path.exists() else []


def test_a_duplicate_of_a_live_member_is_refused(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.start(3)
    before = len(_commits(n1))
    dup = _spawn_duplicate(cluster, n2.id, via=n3)
    assert dup.wait(timeout=30.0) == EXIT_REFUSED
    refused = [e for e in n1.events() if e["event"] == "join_refused"]
    assert refused and refused[-1]["reason"] == "duplicate_id"
    # the member keeps its place; the cluster serves status; no epoch was committed for the dup
    for n in (n1, n2, n3):
        assert cluster.members(n) == {n1.id, n2.id, n3.id}
    assert n2.alive()
    assert len(_commits(n1)) - before <= 1


def _start_slow_detection(cluster: Cluster) -> list[Node]:
    """Three daemons (as ``Cluster.start``) that find a member failed only after
    ``SLOW_FT_S``: time for a duplicate to join before the death is detected."""
    text = cluster.config.read_text()
    text = "\n".join(
        line
        for line in text.splitlines()
        if not line.startswith(("election_timeout", "link_failure_timeout"))
    )
    cluster.config.write_text(
        text + f"\nelection_timeout_min_s = {SLOW_FT_S}\nelection_timeout_max_s = "
        f"{2 * SLOW_FT_S}\nlink_failure_timeout_s = {2 * SLOW_FT_S}\n"
    )
    extra = ("--failure-timeout", str(SLOW_FT_S))
    n1 = cluster.spawn("n1", extra=extra)
    n2 = cluster.spawn("n2", join=n1, neighbors=("n1",), extra=extra)
    n3 = cluster.spawn("n3", join=n2, neighbors=("n2", "n1"), extra=extra)
    ids = {"n1", "n2", "n3"}
    wait_until(lambda: all(cluster.members(x) == ids for x in (n1, n2, n3)), "all see all")
    return [n1, n2, n3]


def test_a_duplicate_of_a_member_killed_before_detection(cluster: Cluster) -> None:
    n1, n2, n3 = _start_slow_detection(cluster)
    before = len(_commits(n1))
    n2.proc.send_signal(signal.SIGKILL)
    n2.proc.wait(timeout=10)
    dup = _spawn_duplicate(cluster, n2.id, via=n3)
    code = dup.wait(timeout=30.0)
    assert not [e for e in n1.events() if e["event"] == "node_failed"]  # refused before it
    wait_until(lambda: cluster.members(n1) == {n1.id, n3.id}, "n2 detected failed and removed")
    wait_until(lambda: cluster.members(n3) == {n1.id, n3.id}, "n3 sees n2 removed")
    # bounded: the failure's scale-in (and its link changes), nothing for the duplicate
    settled = len(_commits(n1))
    assert settled - before <= 4, [e.get("primitive") for e in _commits(n1)[before:]]
    assert n3.status().scheduler == n1.id
    assert code == EXIT_REFUSED


def test_a_restart_at_the_same_address_before_detection_replaces_it(cluster: Cluster) -> None:
    # slow detection: the restart's join must reach the scheduler before n2 is found failed
    # (a 0.5 s failure timeout made that a race on a loaded machine)
    n1, n2, n3 = _start_slow_detection(cluster)
    with n2.client() as c:  # the old incarnation had a trainer
        c.register_trainer("tcp://127.0.0.1:1", "tcp://127.0.0.1:2", True, [64, 32])
    wait_until(lambda: _trainer_of(n1, n2.id) == "training", "n2's trainer registered")
    before = len(_commits(n1))
    n2.proc.send_signal(signal.SIGKILL)
    n2.proc.wait(timeout=10)
    dup = _spawn_duplicate(cluster, n2.id, via=n3, port=n2.port)
    wait_until(lambda: _joined(cluster, n2.id) or dup.poll() is not None, "the restart joined")
    assert dup.poll() is None
    # the old incarnation was treated as failed: its trainer registration is gone
    wait_until(lambda: _trainer_of(n1, n2.id) == "none", "the old trainer dropped")
    replaced = [e for e in n1.events() if e["event"] == "incarnation_replaced"]
    assert replaced and replaced[0]["peer"] == n2.id
    wait_until(
        lambda: all(_trainer_of(n, n2.id) == "none" for n in (n1, n3)), "members see it dropped"
    )
    assert cluster.members(n3) == {n1.id, n2.id, n3.id}
    # bounded: the replacement (and a failure scale-in/out at most), no storm
    settled = len(_commits(n1))
    assert settled - before <= 4, [e.get("cause") for e in _commits(n1)[before:]]
    wait_until(lambda: dup.poll() is None and n3.status().epoch == n1.status().epoch, "in step")
    assert len(_commits(n1)) == settled


def _trainer_of(node: Node, of: str) -> str | None:
    return {n.id: n.trainer.value for n in node.status().nodes}.get(of)


def _joined(cluster: Cluster, of: str) -> bool:
    return any(e["event"] == "joined" for e in _dup_events(cluster, of))
