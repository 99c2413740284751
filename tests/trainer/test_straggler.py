"""A trainer that stops must not stall the others, and the right member must be blamed.

Three real training processes, each with its embedded daemon, over loopback. The fault is real:
one worker's own process is stopped with SIGSTOP (its daemon, a separate process, keeps
heartbeating, so the failure detector does not see it) and later resumed with SIGCONT. The
daemons run with a small grace (``--straggler-grace 2``). Tests wait for conditions with
generous deadlines and never assert timing; every process group is resumed, killed and reaped
at the end, even when a test fails.

This file is also the worker: ``python test_straggler.py worker --id a --listen tcp://... --out
F --daemon-dir D [--join tcp://...]`` trains a small MLP and appends one JSON line per step to
``F`` (step, epoch, world size, a SHA-256 of its model and optimizer state); a thread appends the
trainer's events (``{"event": ...}``) to ``F.events`` as they happen, also while ``update()``
blocks; the embedded daemon's event log is ``D/events-<id>.jsonl``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

import pytest

from chaos.errors import ChaosTimeout
from chaos.launch import ProcessExited, free_port, kill_and_reap, spawn_worker, wait_until

DEADLINE_S = 120.0
GRACE_S = 2.0
DAEMON_ARGS = ("--heartbeat-interval", "0.2", "--failure-timeout", "1.0")


class Member:
    """One training process (and, in its process group, its embedded daemon)."""

    def __init__(self, node_id: str, tmp: Path, proc: subprocess.Popen[bytes], address: str):
        self.id = node_id
        self.out = tmp / f"{node_id}.jsonl"
        self.daemon_dir = tmp / f"d-{node_id}"
        self.proc = proc
        self.address = address

    def records(self) -> list[dict[str, Any]]:
        if not self.out.exists():
            return []
        lines = self.out.read_text().splitlines()
        return [json.loads(line) for line in lines if line.endswith("}")]

    def steps(self) -> list[dict[str, Any]]:
        return [r for r in self.records() if "digest" in r]

    def events(self, kind: str) -> list[dict[str, Any]]:
        path = self.out.with_suffix(".events")
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [e for e in (json.loads(x) for x in lines if x.endswith("}")) if e["event"] == kind]

    def daemon_events(self, kind: str) -> list[dict[str, Any]]:
        path = self.daemon_dir / f"events-{self.id}.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [e for e in (json.loads(x) for x in lines if x.endswith("}")) if e["event"] == kind]

    def log(self) -> str:
        path = self.out.with_suffix(".log")
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""


class Cluster:
    """Starts workers in their own sessions; on close, resumes any stopped one and reaps every
    process group."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.members: dict[str, Member] = {}
        self.stopped: set[int] = set()

    def start(self, node_id: str, join: Member | None, *extra: str) -> Member:
        address = f"tcp://127.0.0.1:{free_port()}"
        argv = [sys.executable, __file__, "worker", "--id", node_id, "--listen", address]
        argv += ["--out", str(self.tmp / f"{node_id}.jsonl")]
        argv += ["--daemon-dir", str(self.tmp / f"d-{node_id}"), *extra]
        for arg in (*DAEMON_ARGS, "--straggler-grace", str(GRACE_S)):
            argv.append(f"--daemon-arg={arg}")
        if join is not None:
            argv += ["--join", join.address]
        log = self.tmp / f"{node_id}.log"
        proc = spawn_worker(argv, log_path=log, append=False)
        member = Member(node_id, self.tmp, proc, address)
        self.members[node_id] = member
        return member

    def stop(self, m: Member) -> None:
        """SIGSTOP of the worker's own process only: its daemon goes on."""
        self.stopped.add(m.proc.pid)
        os.kill(m.proc.pid, signal.SIGSTOP)

    def resume(self, m: Member) -> None:
        os.kill(m.proc.pid, signal.SIGCONT)
        self.stopped.discard(m.proc.pid)

    def wait(self, pred: Callable[[], Any], what: str) -> Any:
        procs = {m.id: m.proc for m in self.members.values()}
        try:
            return wait_until(pred, DEADLINE_S, what, poll_s=0.1, watch=procs)
        except (ProcessExited, ChaosTimeout) as exc:
            logs = "\n".join(f"--- {m.id}\n{m.log()}" for m in self.members.values())
            pytest.fail(f"{exc}\n{logs}")

    def scheduler_events(self, kind: str) -> list[dict[str, Any]]:
        return [e for m in self.members.values() for e in m.daemon_events(kind)]

    def close(self) -> None:
        for pid in list(self.stopped):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        kill_and_reap([m.proc for m in self.members.values()], group=True)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with contextlib.closing(Cluster(tmp_path)) as c:  # reaped even when the test fails
        yield c


def _trains_with(m: Member, world: int, after_step: int = -1) -> bool:
    steps = m.steps()
    return bool(steps) and steps[-1]["world"] == world and steps[-1]["step"] > after_step


def _three(cluster: Cluster, *c_args: str) -> tuple[Member, Member, Member]:
    a = cluster.start("a", None)
    cluster.wait(lambda: a.steps(), "a to train")
    b = cluster.start("b", a)
    cluster.wait(lambda: _trains_with(a, 2) and _trains_with(b, 2), "b to join")
    c = cluster.start("c", a, *c_args)
    cluster.wait(lambda: all(_trains_with(m, 3) for m in (a, b, c)), "c to join")
    return a, b, c


def _common_steps(members: list[Member], first_step: int) -> list[int]:
    steps = [{r["step"] for r in m.steps()} for m in members]
    return sorted(s for s in set.intersection(*steps) if s >= first_step)


def _equal_at_common_steps(members: list[Member], first_step: int) -> int:
    digests = [{r["step"]: r["digest"] for r in m.steps()} for m in members]
    common = _common_steps(members, first_step)
    for s in common:
        assert len({d[s] for d in digests}) == 1, f"members differ at step {s}"
    return len(common)


def test_a_stopped_trainer_is_evicted_the_others_go_on_and_it_rejoins(cluster: Cluster) -> None:
    a, b, c = _three(cluster)
    cluster.stop(c)
    stopped_at = max(r["step"] for r in c.steps())

    # the other two keep training without it, after the grace
    cluster.wait(
        lambda: _trains_with(a, 2, stopped_at + 3) and _trains_with(b, 2, stopped_at + 3),
        "a and b to go on without c",
    )
    evicted = cluster.scheduler_events("straggler_evicted")
    assert [e["peer"] for e in evicted] == ["c"], evicted
    assert evicted[0]["waiting"] and set(evicted[0]["waiting"]) <= {"a", "b"}

    # resumed, c finds itself out of the policy, joins again and pulls the state
    cluster.resume(c)
    cluster.wait(lambda: c.events("evicted"), "c to notice its eviction")
    resumed_at = max(r["step"] for r in a.steps())
    cluster.wait(
        lambda: all(_trains_with(m, 3, resumed_at + 5) for m in (a, b, c)),
        "training to go on with all three",
    )
    # its first join, and the join after its eviction; a thread copies the events, so wait for it
    cluster.wait(lambda: len(c.events("ready")) >= 2, "c's ready event of its rejoin")
    rejoined = c.events("ready")
    assert len(rejoined) == 2, rejoined
    assert c.events("replication_done")  # each join pulled the state
    # the rejoiner records steps from its entry on: wait until all three share a few
    cluster.wait(lambda: len(_common_steps([a, b, c], resumed_at)) >= 3, "3 steps in common")
    assert _equal_at_common_steps([a, b, c], resumed_at) >= 3


def test_a_slow_trainer_sets_the_pace_and_is_never_evicted(cluster: Cluster) -> None:
    # c takes 0.5 s per step (its script sleeps), well below the 2 s grace; a and b wait
    a, b, c = _three(cluster, "--step-time", "0.5")
    start = max(r["step"] for r in c.steps())
    cluster.wait(
        lambda: all(_trains_with(m, 3, start + 12) for m in (a, b, c)),
        "a dozen steps at c's pace",
    )
    assert cluster.scheduler_events("straggler_evicted") == []
    assert all(not m.events("evicted") for m in (a, b, c))
    assert all(r["world"] == 3 for m in (a, b, c) for r in m.steps() if r["step"] > start)


def test_a_failed_round_blames_the_trainer_that_stopped(cluster: Cluster) -> None:
    # the round times out (3 s) long before the grace would evict anyone (60 s): each waiting
    # trainer's round names the neighbour it waited for, but the event names the one stopped
    slow = ("--step-timeout", "3", "--grace", "60", "--policy-timeout", "60")
    a = cluster.start("a", None, *slow)
    cluster.wait(lambda: a.steps(), "a to train")
    b = cluster.start("b", a, *slow)
    cluster.wait(lambda: _trains_with(a, 2) and _trains_with(b, 2), "b to join")
    c = cluster.start("c", a, *slow)
    cluster.wait(lambda: all(_trains_with(m, 3) for m in (a, b, c)), "c to join")
    cluster.stop(c)
    cluster.wait(
        lambda: a.events("allreduce_failed") and b.events("allreduce_failed"),
        "a's and b's rounds to fail",
    )
    blamed = {e["peer"] for m in (a, b) for e in m.events("allreduce_failed")}
    assert blamed == {"c"}, [e for m in (a, b) for e in m.events("allreduce_failed")]
    assert {e["peer"] for e in cluster.scheduler_events("allreduce_failed")} == {"c"}


def test_the_step_beacon_says_when_a_step_ends_and_keeps_saying_it_is_alive_inside(
    tmp_path: Path,
) -> None:
    import zmq

    from chaos.protocol import TrainerProgress, decode
    from chaos.trainer.session import StepBeacon

    endpoint = f"ipc://{tmp_path}/d.ipc"
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    daemon = ctx.socket(zmq.ROUTER)
    daemon.bind(endpoint)
    beacon = StepBeacon(endpoint)
    got: list[TrainerProgress] = []

    def received(n: int) -> bool:
        while daemon.poll(10, zmq.POLLIN):
            msg = decode(daemon.recv_multipart()[-1])
            assert isinstance(msg, TrainerProgress)
            got.append(msg)
        return len(got) >= n

    try:
        beacon.note(4, in_step=True)
        wait_until(lambda: received(1), 10.0, "the step's start")
        beacon.note(5, in_step=False)  # at once: the daemon was told it was inside
        wait_until(lambda: received(2), 10.0, "the step's end")
        assert [(m.step, m.in_step) for m in got] == [(4, True), (5, False)]
        beacon.note(5, in_step=True)
        # while inside update(), the thread keeps saying it is alive, at step 5
        wait_until(lambda: received(4), 10.0, "beats inside the step")
        assert all((m.step, m.in_step) == (5, True) for m in got[2:])
        assert got[-1].elapsed_s > got[2].elapsed_s
    finally:
        beacon.close()
        daemon.close(linger=0)
        ctx.term()


# ----------------------------------------------------------------- the worker


def _worker(argv: list[str]) -> int:
    import argparse
    import logging
    import threading
    import time

    import torch

    from chaos.trainer.worker import (
        EventTail,
        add_member_arguments,
        local_data,
        start_member,
        step_record,
        write_record,
    )

    ap = argparse.ArgumentParser()
    add_member_arguments(ap)
    ap.add_argument("--daemon-dir", type=Path, required=True)
    ap.add_argument("--step-time", type=float, default=0.02)
    ap.add_argument("--step-timeout", type=float, default=30.0)
    ap.add_argument("--policy-timeout", type=float, default=10.0)
    ap.add_argument("--grace", type=float, default=None, help="overrides --straggler-grace")
    args = ap.parse_args(argv)
    if args.grace is not None:
        args.daemon_arg += ["--straggler-grace", str(args.grace)]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    xs, ys = local_data(args.id, 256, 16, 4)
    trainer = start_member(
        args,
        model,
        opt,
        step_timeout_s=args.step_timeout,
        policy_timeout_s=args.policy_timeout,
        daemon_dir=str(args.daemon_dir),
    )
    constructed = list(trainer.events)  # ready, replication_done for a joiner
    tail = EventTail(trainer)  # and what comes next

    def copy_events(lines: TextIO) -> None:
        for ev in constructed:
            write_record(lines, ev)
        while True:
            for ev in tail.new():
                write_record(lines, ev)
            time.sleep(0.05)

    events = args.out.with_suffix(".events").open("a")
    threading.Thread(target=copy_events, args=(events,), daemon=True).start()
    with args.out.open("a") as out:
        write_record(out, {"ready": True, "step": trainer.step, "pid": os.getpid()})
        while True:
            i = trainer.step % 32
            x, y = xs[i * 8 : i * 8 + 8], ys[i * 8 : i * 8 + 8]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            time.sleep(args.step_time)  # stands in for a longer forward/backward pass
            trainer.update()
            trainer.check_state_replication()
            write_record(out, step_record(trainer, model, opt))


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    sys.exit(_worker(sys.argv[2:]))
