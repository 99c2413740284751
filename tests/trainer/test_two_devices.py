"""Two devices in two network namespaces, each a real trainer process started as
``docs/trainer.md`` shows: ``Trainer(model, opt, join=..., listen="tcp://<its address>:P",
cluster_key=...)``, with no ``host``.

* The data plane takes its host from ``listen``, so the joiner reaches the founder's state and
  gradients: the two train together and end bitwise equal.
* On a slow shaped link (tbf) an allreduce takes several times the straggler grace; the members
  that move the round's bytes are not stragglers: nobody is evicted and both take the same steps.
* A trainer behind an external daemon on the network, left on the loopback default, is refused
  at registration with a reason that says what to set, instead of being joined and looping.

Needs root (namespaces, veth pairs, tc); the namespaces and processes are removed by the
fixture of ``test_emulate_network.py`` and by the network's close, even when a test fails.
Nothing about timing is asserted; the deadlines only bound a hang.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from chaos.daemon.config import ipc_endpoint_for

from chaos.emulate import Network
from chaos.launch import daemon_command, daemon_env, private_dir
from chaos.security import ClusterKey
from tests.emulate.test_emulate_network import (
    MBIT,
    _cfg,
    _reap_namespaces,  # noqa: F401 - the autouse fixture that removes every namespace left
    needs_root,
)

WORKER = str(Path(__file__).with_name("worker.py"))
PORT = 27000


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _start(net: Network, node: str, tmp: Path, key: Path, *extra: str) -> subprocess.Popen[str]:
    out = tmp / f"{node}.jsonl"
    argv = [sys.executable, WORKER, "--id", node, "--out", str(out),
            "--listen", f"tcp://{net.address(node)}:{PORT}", "--cluster-key", str(key),
            "--daemon-dir", str(tmp / f"d-{node}"), *extra]  # fmt: skip
    log = (tmp / f"{node}.log").open("w")
    return net.popen(node, argv, stdout=log, stderr=subprocess.STDOUT, text=True)


def _wait_done(procs: dict[str, subprocess.Popen[str]], tmp: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for node, p in procs.items():
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log = (tmp / f"{node}.log").read_text()[-3000:]
            raise AssertionError(f"{node} did not finish within {timeout_s} s:\n{log}") from None
        if p.returncode != 0:
            log = (tmp / f"{node}.log").read_text()[-3000:]
            raise AssertionError(f"{node} exited {p.returncode}:\n{log}")


def _train_pair(tmp: Path, bandwidth_bps: float, steps: int, timeout_s: float,
                *extra: str) -> dict[str, list[dict[str, Any]]]:  # fmt: skip
    """Runs a founder on ``a`` and a joiner on ``b``, which trains ``steps`` steps once in and
    leaves; then the founder is asked to leave. Their records."""
    key = ClusterKey.generate().write(tmp / "cluster.key")
    with Network(_cfg("ab", [("a", "b", bandwidth_bps)])) as net:
        procs = {"a": _start(net, "a", tmp, key, "--max-steps", "1000000", *extra)}
        deadline = time.monotonic() + 120
        while not any("step" in r and r["step"] >= 1 for r in _records(tmp / "a.jsonl")):
            if procs["a"].poll() is not None or time.monotonic() > deadline:
                raise AssertionError((tmp / "a.log").read_text()[-3000:])
            time.sleep(0.2)
        join = f"tcp://{net.address('a')}:{PORT}"
        b = _start(net, "b", tmp, key, "--join", join, "--more-steps", str(steps), *extra)
        try:
            _wait_done({"b": b}, tmp, timeout_s)
        finally:
            (tmp / "a.leave").touch()  # the founder leaves at its next step
        _wait_done(procs, tmp, 120)
    return {n: _records(tmp / f"{n}.jsonl") for n in ("a", "b")}


def _digests(records: list[dict[str, Any]]) -> dict[int, str]:
    """Step -> digest of the steps taken together (world 2)."""
    return {r["step"]: r["digest"] for r in records if "digest" in r and r["world"] == 2}


@needs_root
def test_two_devices_train_together_with_the_documented_call_and_no_host(tmp_path: Path) -> None:
    recs = _train_pair(tmp_path, 100 * MBIT, 20, 300, "--step-time", "0.05")
    a, b = _digests(recs["a"]), _digests(recs["b"])
    together = [r["step"] for r in recs["b"] if r.get("world") == 2]
    assert len(together) >= 15, recs["b"][-3:]  # its first steps may replay the log
    paired = [s for s in together if s in a]
    assert len(paired) >= len(together) - 1  # the founder may rerun its last alone: the joiner left
    assert [a[s] for s in paired] == [b[s] for s in paired]  # bitwise equal
    assert not [r for r in recs["b"] if r.get("event") in ("entry_failed", "join_again_failed")]


@needs_root
def test_a_slow_link_is_not_a_straggler(tmp_path: Path) -> None:
    """2 Mbit/s and gradients of about 1.3 MB: one allreduce moves that much each way (seconds,
    several times the 1.5 s grace); both members wait in it, moving its bytes."""
    recs = _train_pair(tmp_path, 2 * MBIT, 5, 500, "--width", "16000", "--step-time", "0.0",
                       "--join-mode", "barrier", "--daemon-arg=--straggler-grace",
                       "--daemon-arg=1.5")  # fmt: skip
    events = [r.get("event") for n in recs for r in recs[n]]
    assert "evicted" not in events, events
    a, b = _digests(recs["a"]), _digests(recs["b"])
    steps = [r["step"] for r in recs["b"] if "digest" in r]
    assert len(steps) == 5 and all(r["world"] == 2 for r in recs["b"] if "world" in r)
    # the founder's records of the same steps, taken together (its last may be rerun alone:
    # the joiner leaves once its own last round completed)
    paired = [r["step"] for r in recs["a"] if r.get("world") == 2]
    assert paired and set(paired) <= set(steps) and len(paired) >= len(steps) - 1, paired
    assert [a[s] for s in paired] == [b[s] for s in paired]  # bitwise equal


@needs_root
def test_a_trainer_advertising_loopback_to_a_networked_cluster_is_refused(tmp_path: Path) -> None:
    key = ClusterKey.generate().write(tmp_path / "cluster.key")
    script = (
        "import sys, torch\n"
        "from chaos.errors import ChaosError\n"
        "from chaos.trainer import Trainer\n"
        "m = torch.nn.Linear(4, 2)\n"
        "o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "try:\n"
        "    Trainer(m, o, daemon=sys.argv[1], node_id='a', cluster_key=sys.argv[2],\n"
        "            join_timeout_s=20.0)\n"
        "except ChaosError as e:\n"
        "    print('REFUSED', type(e).__name__, e, flush=True)\n"
        "    sys.exit(3)\n"
    )
    with Network(_cfg("ab", [("a", "b", 100 * MBIT)])) as net:
        run = tmp_path / "d-a"
        private_dir(run)
        ipc = ipc_endpoint_for(str(run))
        argv = daemon_command("a", f"tcp://{net.address('a')}:{PORT}", cluster_key=key)
        daemon = net.popen("a", argv, env=daemon_env(run, "INFO"), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            res = net.exec("a", [sys.executable, "-c", script, ipc, str(key)], timeout_s=120,
                           check=False)  # fmt: skip
        finally:
            daemon.kill()
    assert res.returncode == 3, res.stdout + res.stderr
    assert "loopback" in res.stdout and "host" in res.stdout, res.stdout


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-v"]))
