"""A trainer that dies behind a live standalone daemon: real daemons, real training scripts.

The documented deployment is a ``chaos-daemon`` per device and a script with
``Trainer(..., daemon=...)``. When a script is killed and its daemon keeps running, the daemon
sees the trainer's process gone and ends its registration: the node stays a member without a
trainer, and the other trainers go on training without it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from daemon_helpers import Cluster, Node, wait_until

from chaos.launch import kill_and_reap

_SCRIPT = Path(__file__).with_name("attached_trainer.py")


def _steps(out: Path) -> list[dict[str, Any]]:
    if not out.exists():
        return []
    recs = []
    for line in out.read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written
    return recs


def _last_step(out: Path) -> int:
    recs = _steps(out)
    return recs[-1]["step"] if recs else -1


def _trainer_states(node: Node) -> dict[str, str]:
    return {n.id: n.trainer.value for n in node.status().nodes}


def _spawn_trainer(
    node: Node, tmp: Path, procs: list[subprocess.Popen[bytes]], joining: Node | None
) -> Path:
    out = tmp / f"steps-{node.id}.jsonl"
    argv = [sys.executable, str(_SCRIPT), "--id", node.id, "--daemon", node.ipc, "--out", str(out)]
    if joining is not None:
        argv += ["--joining", joining.address]
    log = (tmp / f"trainer-{node.id}.log").open("wb")
    procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
    return out


def test_a_killed_trainer_leaves_training_and_the_others_go_on(
    cluster: Cluster, tmp_path: Path
) -> None:
    n1, n2, n3 = cluster.start(3)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        outs = {n1.id: _spawn_trainer(n1, tmp_path, procs, None)}
        wait_until(lambda: _last_step(outs[n1.id]) >= 1, "the first trainer steps", 60.0)
        for node in (n2, n3):
            outs[node.id] = _spawn_trainer(node, tmp_path, procs, n1)
        wait_until(
            lambda: set(_trainer_states(n1).values()) == {"training"}, "three trainers", 90.0
        )
        base = {k: _last_step(v) for k, v in outs.items()}
        wait_until(
            lambda: all(_last_step(outs[k]) > base[k] + 3 for k in outs), "all three step", 60.0
        )
        victim = procs[2]  # n3's script; its daemon keeps running
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        wait_until(
            lambda: _trainer_states(n1).get(n3.id) == "none", "n3's trainer state is none", 30.0
        )
        assert n3.alive() and n3.id in cluster.members(n1)  # its daemon stays a member
        killed_at = {k: _last_step(outs[k]) for k in (n1.id, n2.id)}
        wait_until(
            lambda: all(_last_step(outs[k]) > killed_at[k] + 5 for k in killed_at),
            "the other trainers go on",
            60.0,
        )
        assert _steps(outs[n1.id])[-1]["world"] == 2
        gone = [e for e in n3.events() if e.get("event") == "trainer_gone"]
        assert gone, "n3's daemon logs that its trainer exited"
        assert any("exited" in note for note in n3.status().notes)
        st = cluster.cli(n3, "status")
        assert "note: trainer process" in st.stdout, st.stdout + st.stderr
    finally:
        kill_and_reap(procs, timeout_s=10.0)
