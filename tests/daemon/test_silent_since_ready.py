"""A trainer stopped right after its ready, before its first progress report, is still found a
straggler: its daemon starts the trainer's silence clock at the ready (real daemons on
loopback; the trainers are clients of each daemon's local endpoint)."""

from __future__ import annotations

from chaos.daemon.client import DaemonClient
from daemon_helpers import Cluster, Node, wait_until

from chaos.launch import free_port
from chaos.protocol import TrainerReady
from chaos.trainer.session import StepBeacon

GRACE_S = 1.0
SIZES = [64, 32]


def _register(node: Node, has_state: bool) -> None:
    ep = f"tcp://127.0.0.1:{free_port()}"
    sh = f"tcp://127.0.0.1:{free_port()}"
    with DaemonClient(node.ipc, timeout_s=10.0) as c:
        assert c.register_trainer(ep, sh, has_state, SIZES, timeout_s=10.0).ok


def test_a_trainer_silent_since_its_ready_is_evicted(cluster: Cluster) -> None:
    extra = ("--straggler-grace", str(GRACE_S))
    n1 = cluster.spawn("n1", extra=extra)
    n2 = cluster.spawn("n2", join=n1, neighbors=("n1",), extra=extra)
    wait_until(lambda: cluster.members(n1) == {"n1", "n2"}, "n2 admitted")
    _register(n1, True)
    _register(n2, False)
    # n1's trainer waits inside update() at step 5 (its beacon says so every interval)
    beacon = StepBeacon(n1.ipc)
    try:
        beacon.note(5, in_step=True)
        # n2's trainer is ready at step 5, then says nothing more (as if stopped at once)
        with DaemonClient(n2.ipc, timeout_s=10.0) as c:
            assert c.trainer_event(TrainerReady(elapsed_s=0.1, step=5), timeout_s=10.0).ok
        wait_until(
            lambda: [e for e in n1.events() if e["event"] == "straggler_evicted"],
            "n2 evicted as a straggler",
        )
    finally:
        beacon.close()
    [ev] = [e for e in n1.events() if e["event"] == "straggler_evicted"]
    assert ev["peer"] == "n2" and ev["waiting"] == ["n1"]
