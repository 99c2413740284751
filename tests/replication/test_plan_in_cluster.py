"""The plan a joiner executes is the scheduler's, on a real cluster past step 128.

Two training processes (``tests/trainer/worker.py``, each with its embedded daemon) on loopback:
``a`` founds the cluster and trains past step 128, where its runtime record grows by one byte;
``b`` joins and pulls the state from ``a``. The scheduler (``a``'s daemon) logs the plan it
issued (``replication_planned``) and, from ``b``'s report, the pull ``b`` executed
(``replication_executed``): they are the same assignment, and the per-shard cost fitted to that
pull is what ``chaos-daemon status`` shows. Every process group is killed and reaped at the end.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chaos.launch import daemon_cli, free_port, kill_and_reap, spawn_worker, wait_until

WORKER = Path(__file__).parent.parent / "trainer" / "worker.py"
DAEMON_ARGS = ("--heartbeat-interval", "0.2", "--failure-timeout", "2.0")
DEADLINE_S = 180.0


class _Procs:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[Any]] = {}
        self.ports: dict[str, int] = {}

    def start(self, node_id: str, join: str | None) -> None:
        port = free_port()
        out = self.tmp / f"{node_id}.jsonl"
        argv = [sys.executable, str(WORKER), "--id", node_id, "--out", str(out),
                "--listen", f"tcp://127.0.0.1:{port}", "--daemon-dir", str(self.run_dir(node_id)),
                "--step-time", "0.005", "--max-steps", "100000"]  # fmt: skip
        argv += [f"--daemon-arg={a}" for a in DAEMON_ARGS]
        if join is not None:
            argv += ["--join", f"tcp://127.0.0.1:{self.ports[join]}"]
        self.procs[node_id] = spawn_worker(argv, log_path=out.with_suffix(".log"), append=False)
        self.ports[node_id] = port

    def run_dir(self, node_id: str) -> Path:
        return self.tmp / f"run-{node_id}"

    def records(self, node_id: str) -> list[dict[str, Any]]:
        path = self.tmp / f"{node_id}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(x) for x in lines if x.endswith("}")]

    def step(self, node_id: str) -> int:
        steps = [r["step"] for r in self.records(node_id) if "digest" in r]
        return steps[-1] if steps else -1

    def events(self, node_id: str) -> list[dict[str, Any]]:
        path = self.run_dir(node_id) / f"events-{node_id}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(x) for x in lines if x.endswith("}")]

    def wait(self, pred: Any, what: str) -> Any:
        return wait_until(pred, DEADLINE_S, what, poll_s=0.2, watch=self.procs)

    def logs(self) -> str:
        return "\n".join(
            f"--- {n}\n{(self.tmp / f'{n}.log').read_text(errors='replace')[-3000:]}"
            for n in self.procs
            if (self.tmp / f"{n}.log").exists()
        )


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[_Procs]:
    p = _Procs(tmp_path)
    try:
        yield p
    finally:
        kill_and_reap(list(p.procs.values()), group=True)


def test_the_joiner_executes_the_schedulers_plan_past_step_128(procs: _Procs) -> None:
    procs.start("a", None)
    procs.wait(lambda: procs.step("a") >= 140, "a to train past step 128")
    procs.start("b", "a")
    try:
        procs.wait(lambda: any(r.get("ready") for r in procs.records("b")), "b to join")
        executed = procs.wait(
            lambda: [e for e in procs.events("a") if e["event"] == "replication_executed"],
            "the scheduler to log b's pull",
        )
    except Exception as exc:
        pytest.fail(f"{exc}\n{procs.logs()}")
    # (the daemon's own join plans nothing: its trainer had not said its state's size yet)
    planned = [e for e in procs.events("a")
               if e["event"] == "replication_planned" and not e["skipped"]]  # fmt: skip
    assert [e["peer"] for e in planned] == ["b"] and {e["peer"] for e in executed} == {"b"}
    ready = next(r for r in procs.records("b") if r.get("ready"))
    assert ready["step"] >= 140, "the pull was not past step 128"
    # a catch-up join pulls twice: the snapshot (this plan) and, when it enters, the chunks that
    # still differ (planned afresh: its executed ranges differ by the chunks held, said so)
    plan, done = planned[0], executed[0]
    # the assignment b pulled is the one the scheduler issued, byte range for byte range
    assert done["assignment"] == plan["assignment"] and plan["assignment"]
    assert done["as_planned"] is True and done["reason"] == "" and done["replans"] == 0
    # the per-shard cost was fitted to this pull, and status shows the measured value
    assert done["per_shard_cost_fit_s"] is not None and done["per_shard_cost_s"] is not None
    res = subprocess.run(
        daemon_cli("status", "--json"),
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "CHAOS_DAEMON_DIR": str(procs.run_dir("a"))},
    )
    assert res.returncode == 0, res.stderr
    notes = json.loads(res.stdout)["notes"]
    assert any(re.search(r"measured over [12] pulls", n) for n in notes), notes
