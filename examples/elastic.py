"""Shared helpers of the examples: the one-command launcher, its options and the event printer.

Not an example itself. ``digits_classifier.py``, ``lora_gpt.py`` and ``nanogpt_style.py``
import it (it sits beside them, so ``python examples/NAME.py`` finds it) for three jobs:

* **Worker side**: :class:`EventPrinter` prints the membership events a :class:`Trainer` records
  (someone joined or left, this node pulled or served the state, a step was rerun) as they
  happen, and :func:`progress` prints one step line.
* **Command line**: the options every example shares (:func:`example_parser`, checked by
  :func:`parse_arguments`), and :func:`launch`, which runs the scenario with the example's
  own script as every worker (:func:`worker_command`, passing on options by :func:`forward`).
* **Launcher side**: :func:`run_scenario` starts the worker processes on this machine and walks
  them through a small elastic scenario: the first node starts the cluster, the next ones join,
  one more joins in the middle of training, one leaves gracefully, then everyone leaves. It
  prints what the workers print, prefixed by their node id, and it reaps every process it
  started, also on Ctrl+C or SIGTERM.

Workers leave the way a user's script does: the launcher sends them SIGTERM, which
:func:`chaos.trainer.capture_exit_event` turns into a graceful ``request_node_exit()`` at the
next step boundary.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from chaos.errors import ChaosTimeout
from chaos.launch import (
    ProcessExited,
    free_tcp_address,
    kill_and_reap,
    signal_group,
    spawn_worker,
    wait_until,
)

# ----------------------------------------------------------------------------- worker side


def progress(trainer: Any, **metrics: float) -> None:
    """Prints one progress line: ``[n1] step 40 | world 3 | epoch 5 | loss 0.4123 | ...``.

    The launcher reads the step from this line to pace its scenario.

    Args:
        trainer: The :class:`chaos.trainer.Trainer` (its node id, step, world size and epoch).
        **metrics: The values to print after them, by name.
    """
    parts = [f"[{trainer.node_id}] step {trainer.step:5d}", f"world {trainer.world_size}"]
    parts += [f"epoch {trainer.epoch:3d}"]
    parts += [f"{name} {value:.4f}" for name, value in metrics.items()]
    print(" | ".join(parts), flush=True)


class EventPrinter:
    """Prints the trainer's new events (``trainer.events``) as readable lines.

    It prints the events recorded so far (joining the cluster) when it is made. Call
    :meth:`flush` after every ``trainer.update()``: membership changes are installed at step
    boundaries, so that is when they become visible.

    Args:
        trainer: The :class:`chaos.trainer.Trainer` whose events to print.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self._seen = 0
        self._members: list[str] | None = None
        self.flush()

    def flush(self) -> None:
        """Prints every event recorded since the last call."""
        events = self.trainer.events
        for event in events[self._seen :]:
            line = self._format(event)
            if line:
                print(f"[{self.trainer.node_id}] ** {line}", flush=True)
        self._seen = len(events)

    def _format(self, ev: dict[str, Any]) -> str | None:
        kind = ev["event"]
        if kind == "membership":
            members = list(ev["members"])
            before, self._members = self._members, members
            text = f"membership epoch {ev['epoch']}: {' '.join(members)}"
            if before is None:
                return text
            joined = [m for m in members if m not in before]
            left = [m for m in before if m not in members]
            changes = [f"joined: {' '.join(joined)}"] if joined else []
            changes += [f"left: {' '.join(left)}"] if left else []
            return f"{text} ({'; '.join(changes) or 'new topology'})"
        if kind == "ready":
            return (
                f"ready: training member at step {ev['step']}, epoch {ev['epoch']} "
                f"({ev['elapsed_s']:.2f} s in Trainer())"
            )
        if kind == "replication_done":
            donors = ", ".join(f"{d} {b / 1024:.0f} KiB" for d, b in sorted(ev["donors"].items()))
            return f"state pulled in {ev['elapsed_s']:.2f} s from {donors}"
        if kind == "serving":
            return f"serving my state to joiner {ev['joiner']} (epoch {ev['epoch']})"
        if kind == "left":
            return f"left the cluster at step {ev['step']}"
        if kind == "restart":
            return f"step {ev['step']} rerun under epoch {ev['epoch']}: {ev['reason']}"
        if kind == "allreduce_failed":
            return f"allreduce of step {ev['step']} failed: peer {ev['peer']} lost"
        return f"{kind} {ev}"


# ----------------------------------------------------------------------------- launcher side

_STEP_LINE = re.compile(r"^\[(?P<node>[^\]]+)\] step\s+(?P<step>\d+)")


class LaunchError(RuntimeError):
    """A worker failed, or the scenario did not progress within its timeout."""


@dataclass
class _Worker:
    node_id: str
    address: str
    proc: subprocess.Popen[str]
    step: int = -1
    ready: bool = False
    reader: threading.Thread | None = field(default=None, repr=False)


class Launcher:
    """Starts worker processes, prefixes and parses their output, and reaps them.

    Each worker runs in its own session (so its embedded ``chaos-daemon`` child is in its process
    group and is reaped with it) with a private temporary directory for the daemons' run
    directories, removed by :meth:`close`.

    Args:
        worker_argv: Builds a worker's command line from ``(node_id, listen, join)``.
        timeout_s: Longest wait for any one stage of the scenario.
    """

    def __init__(
        self, worker_argv: Callable[[str, str, str | None], list[str]], timeout_s: float
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.worker_argv = worker_argv
        self.timeout_s = timeout_s
        self.workers: dict[str, _Worker] = {}
        self._tmp = tempfile.mkdtemp(prefix="chaos-example-")
        self._lock = threading.Lock()

    def say(self, text: str) -> None:
        """Prints a launcher line."""
        with self._lock:
            print(f"== {text}", flush=True)

    def start(self, node_id: str, join: str | None) -> _Worker:
        """Starts one worker; ``join`` is a member's address, or ``None`` for a new cluster."""
        address = free_tcp_address()
        proc = spawn_worker(  # a text pipe; SIGTERM (a graceful leave) if the launcher dies
            self.worker_argv(node_id, address, join),
            log_path=None,
            env={"PYTHONUNBUFFERED": "1", "TMPDIR": self._tmp},
            term_on_parent_death=True,
        )
        worker = _Worker(node_id, address, proc)
        worker.reader = threading.Thread(target=self._pump, args=(worker,), daemon=True)
        worker.reader.start()
        self.workers[node_id] = worker
        return worker

    def _pump(self, worker: _Worker) -> None:
        stream: IO[str] | None = worker.proc.stdout
        if stream is None:
            return
        for line in stream:
            line = line.rstrip("\n")
            match = _STEP_LINE.match(line)
            if match and match["node"] == worker.node_id:
                worker.step = int(match["step"])
            if f"[{worker.node_id}] ** ready:" in line:
                worker.ready = True
            with self._lock:
                print(line if line.startswith("[") else f"[{worker.node_id}] {line}", flush=True)

    def wait(self, pred: Callable[[], bool], what: str) -> None:
        """Waits until ``pred()`` holds.

        Raises:
            LaunchError: a worker exited with an error, or ``timeout_s`` passed.
        """

        procs = {nid: w.proc for nid, w in self.workers.items()}
        try:
            wait_until(pred, self.timeout_s, what, watch=procs)
        except ProcessExited as exc:
            raise LaunchError(str(exc)) from exc
        except ChaosTimeout as exc:
            raise LaunchError(f"timed out after {self.timeout_s:.0f} s waiting for {what}") from exc

    def leave(self, node_ids: Sequence[str], timeout_s: float = 30.0) -> None:
        """Asks workers to leave (SIGTERM: a graceful scale-in) and waits for them to exit.

        Raises:
            LaunchError: a worker exited with an error or did not exit within ``timeout_s``.
        """
        for nid in node_ids:
            proc = self.workers[nid].proc
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for nid in node_ids:
            w = self.workers[nid]
            try:
                code = w.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired as exc:
                raise LaunchError(f"{nid} did not leave within {timeout_s:.0f} s") from exc
            if w.reader is not None:
                w.reader.join(timeout=5.0)
            if code != 0:
                raise LaunchError(f"{nid} exited with code {code}")

    def close(self, timeout_s: float = 20.0) -> None:
        """Stops every worker still running and reaps them all.

        A training member gets SIGTERM (a graceful leave) and, after ``timeout_s``, SIGKILL of its
        process group; a worker that is still joining is killed at once. Then the temporary
        directory is removed.
        """
        for w in self.workers.values():
            if w.proc.poll() is not None:
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if w.ready:
                    w.proc.send_signal(signal.SIGTERM)  # a member: leave gracefully
                else:
                    signal_group(w.proc, signal.SIGKILL)  # still joining: nothing to hand over
        deadline = time.monotonic() + timeout_s
        for w in self.workers.values():
            try:
                w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # The worker's group holds its embedded daemon; make sure nothing is left.
            kill_and_reap([w.proc], group=True, timeout_s=10.0)
            if w.reader is not None:
                w.reader.join(timeout=5.0)  # print what the worker said last
        shutil.rmtree(self._tmp, ignore_errors=True)


def _is_ready(worker: _Worker) -> bool:
    return worker.ready


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_scenario(
    worker_argv: Callable[[str, str, str | None], list[str]],
    nodes: int,
    phase_steps: int,
    timeout_s: float = 120.0,
) -> int:
    """Runs the examples' elastic scenario on this machine and returns an exit code.

    1. ``n1`` starts a new cluster; ``n2`` .. ``n{N-1}`` join it one after the other.
    2. After ``phase_steps`` steps, ``n{N}`` joins in the middle of training: it pulls the
       current state from the members and takes part from the next step on.
    3. ``phase_steps`` steps later, ``n2`` leaves gracefully (scale-in) and the others go on.
    4. After ``phase_steps`` more steps every worker leaves; the launcher reaps them.

    With ``nodes=2`` the mid-training joiner is ``n2``, and it is also the one that leaves.

    Args:
        worker_argv: Builds a worker's command line from ``(node_id, listen, join)``.
        nodes: Number of worker processes, at least 2.
        phase_steps: Training steps between two membership changes.
        timeout_s: Longest wait for any one stage.

    Returns:
        0 on success, 1 when a worker failed or a stage timed out, 130 on Ctrl+C.

    Raises:
        ValueError: fewer than 2 nodes or a non-positive ``phase_steps``.
    """
    if nodes < 2:
        raise ValueError(f"the scenario needs at least 2 nodes, got {nodes}")
    if phase_steps < 1:
        raise ValueError(f"phase_steps must be at least 1, got {phase_steps}")
    ids = [f"n{i}" for i in range(1, nodes + 1)]
    launcher = Launcher(worker_argv, timeout_s)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    t0 = time.monotonic()
    try:
        _play(launcher, ids, phase_steps)
        launcher.say(f"all {nodes} workers exited cleanly in {time.monotonic() - t0:.1f} s")
        return 0
    except LaunchError as exc:
        launcher.say(f"FAILED: {exc}")
        return 1
    except KeyboardInterrupt:
        launcher.say("interrupted: asking every worker to leave")
        return 130
    finally:
        launcher.close()
        signal.signal(signal.SIGTERM, previous)


def _play(launcher: Launcher, ids: list[str], phase_steps: int) -> None:
    """The stages of :func:`run_scenario`: joins, a mid-training join, a leave, then the end.

    Raises:
        LaunchError: a worker failed or a stage timed out.
    """
    first, late, leaver = ids[0], ids[-1], ids[1]
    launcher.say(f"{first} starts a new cluster")
    founder = launcher.start(first, None)
    launcher.wait(lambda: founder.ready, f"{first} to start")
    for nid in ids[1:-1]:
        launcher.say(f"{nid} joins through {first}")
        w = launcher.start(nid, founder.address)
        launcher.wait(functools.partial(_is_ready, w), f"{nid} to join")
    mark = founder.step
    launcher.wait(lambda: founder.step >= mark + phase_steps, "training")
    launcher.say(f"{late} joins in the middle of training (cluster at step {founder.step})")
    joiner = launcher.start(late, founder.address)
    launcher.wait(lambda: joiner.ready and joiner.step >= 0, f"{late} to join")
    mark = joiner.step
    launcher.wait(lambda: joiner.step >= mark + phase_steps, f"{late} to train")
    launcher.say(f"{leaver} leaves gracefully (scale-in) at about step {founder.step}")
    launcher.leave([leaver])
    mark = founder.step
    launcher.wait(lambda: founder.step >= mark + phase_steps, "training without the leaver")
    rest = [nid for nid in reversed(ids) if launcher.workers[nid].proc.poll() is None]
    launcher.say(f"training done; {', '.join(rest)} leave")
    for nid in rest:  # one at a time; the founder (the first scheduler) last
        launcher.leave([nid])


# ----------------------------------------------------------------------------- command line


def example_parser(doc: str, phase_steps: int, data: str) -> argparse.ArgumentParser:
    """An example's parser, with the options every example has.

    The launcher's: ``--nodes``, ``--phase-steps``, ``--timeout``; a worker's: ``--worker``,
    ``--id``, ``--listen``, ``--join``, ``--shard``, ``--shards``. The example adds its own,
    ``--log-every`` among them, then calls :func:`parse_arguments`.

    Args:
        doc: The example's docstring (its first line describes the command).
        phase_steps: The default of ``--phase-steps`` (training steps between two changes).
        data: What a worker's ``--shard`` is a part of, for the help (``"the text"``).

    Returns:
        The parser.
    """
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=3, help="worker processes to launch (>= 2)")
    ap.add_argument("--phase-steps", type=int, default=phase_steps,
                    help="steps between membership changes")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds allowed per stage")
    ap.add_argument("--worker", action="store_true", help="run one cluster member")
    ap.add_argument("--id", help="worker: node id")
    ap.add_argument("--listen", help="worker: its daemon's endpoint, tcp://HOST:PORT")
    ap.add_argument("--join", default=None, help="worker: a member's endpoint to join through")
    ap.add_argument("--shard", type=int, default=0, help=f"worker: which part of {data}")
    ap.add_argument("--shards", type=int, default=1, help="worker: in how many parts")
    return ap


def parse_arguments(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parses and checks an example's command line (the parser exits with a usage error).

    A worker needs ``--id`` and a ``--shard`` in ``[0, --shards)``; a launcher at least 2
    ``--nodes`` and more ``--phase-steps`` than ``--log-every``.

    Args:
        parser: From :func:`example_parser`, with a ``--log-every`` option added.
        argv: The arguments (``None``: ``sys.argv``).

    Returns:
        The parsed arguments.
    """
    args = parser.parse_args(argv)
    if args.worker:
        if not args.id:
            parser.error("--worker needs --id")
        if not 0 <= args.shard < args.shards:
            parser.error(f"--shard must be in [0, {args.shards})")
        return args
    if args.nodes < 2:
        parser.error("--nodes must be at least 2")
    if args.phase_steps <= args.log_every:
        parser.error("--phase-steps must be larger than --log-every")
    return args


def forward(args: argparse.Namespace, *names: str) -> list[str]:
    """The options ``names`` of the launcher's ``args`` as a worker's arguments.

    Args:
        args: The launcher's parsed arguments.
        *names: Attribute names (``"log_every"`` is passed on as ``--log-every``); one whose
            value is ``None`` is left out.

    Returns:
        ``["--name", "value", ...]``.
    """
    out: list[str] = []
    for name in names:
        value = getattr(args, name)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def worker_command(
    script: str | Path, node_id: str, listen: str, join: str | None, nodes: int, *args: str
) -> list[str]:
    """The command line that runs ``script`` as the scenario's worker ``node_id``.

    Worker ``nK`` trains on part ``K - 1`` of ``nodes`` parts of the data.

    Args:
        script: The example.
        node_id: ``n1`` .. ``nN``.
        listen: Its daemon's endpoint.
        join: A member's endpoint to join through (``None``: it starts the cluster).
        nodes: The number of workers of the scenario.
        *args: The example's own worker arguments.

    Returns:
        The command, run with this Python interpreter.
    """
    cmd = [sys.executable, str(script), "--worker", "--id", node_id, "--listen", listen]
    cmd += ["--shard", str(int(node_id[1:]) - 1), "--shards", str(nodes), *args]
    return cmd + (["--join", join] if join else [])


def launch(
    script: str | Path,
    args: argparse.Namespace,
    options: Sequence[str] = (),
    extra: Callable[[str], list[str]] | None = None,
) -> int:
    """Runs :func:`run_scenario` with ``script``'s workers and returns its exit code.

    Args:
        script: The example; every worker runs it with ``--worker`` (:func:`worker_command`).
        args: The launcher's parsed arguments (``--nodes``, ``--phase-steps``, ``--timeout``).
        options: The names of the launcher's options that every worker gets too
            (:func:`forward`).
        extra: More arguments for one worker, by its node id.

    Returns:
        0 on success, 1 when a worker failed or a stage timed out, 130 on Ctrl+C.
    """

    def argv_for(node_id: str, listen: str, join: str | None) -> list[str]:
        own = forward(args, *options) + (extra(node_id) if extra is not None else [])
        return worker_command(script, node_id, listen, join, args.nodes, *own)

    return run_scenario(argv_for, args.nodes, args.phase_steps, args.timeout)
