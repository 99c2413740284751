"""One training process of ``chaos-bench primitives``: a real cluster member that times its steps.

Run as ``python -m chaos.bench.primitives_worker --id ID --listen tcp://HOST:PORT --out FILE
[--join tcp://...]``. It trains a small MLP through a :class:`chaos.trainer.Trainer` (with its
embedded daemon) and appends one JSON line per step to ``--out``::

    {"step": 41, "epoch": 6, "world": 4, "t0": ..., "tu": ..., "t1": ...}

``t0`` is when the step's gradient computation began, ``tu`` when ``trainer.update()`` was
called and ``t1`` when ``update()`` and ``check_state_replication()`` had returned (``time.time()``
seconds, comparable between the processes of one host). SIGTERM makes it leave gracefully at its
next step boundary (``capture_exit_event`` then ``request_node_exit``), after which it writes
``{"left": true, "t_leave": ..., "t_left": ...}``. The trainer's events (a rerun round, a new
membership, ...) are written too, as ``{"trainer_event": KIND, ...}`` lines before the step's.

The gradient computation is a real forward and backward pass followed by ``--compute-s`` of
sleep, which stands in for the rest of a device's compute: on one shared host it models devices
that each compute on their own hardware, which is what the control path overlaps with.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

import torch

from chaos.trainer import Trainer, capture_exit_event
from chaos.trainer.worker import (
    EventTail,
    add_member_arguments,
    local_data,
    start_member,
    write_record,
)


def main(argv: list[str] | None = None) -> int:
    """Runs one member until SIGTERM (then leaves) or ``--max-steps``.

    Returns:
        The process exit code.
    """
    args = _parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _model(args.width)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    xs, ys = local_data(args.id, 32, 64, 10)
    trainer = start_member(
        args,
        model,
        opt,
        step_timeout_s=args.step_timeout_s,
        policy_timeout_s=args.policy_timeout_s,
        policy_notices=not args.no_policy_notices,
        daemon_dir=args.daemon_dir,
    )
    with args.out.open("a") as out:
        ready = {"ready": True, "step": trainer.step, "epoch": trainer.epoch, "t": time.time()}
        write_record(out, ready)
        _train(trainer, model, opt, (xs, ys), args, out)
        t_leave = time.time()
        trainer.request_node_exit()
        left = [e["t"] for e in trainer.events if e["event"] == "left"]
        done = {"left": True, "t_leave": t_leave, "t_left": left[-1] if left else None}
        write_record(out, done)
    return 0


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parses the worker's command line.

    Args:
        argv: The arguments (``None``: ``sys.argv[1:]``).

    Returns:
        The parsed arguments.

    Raises:
        SystemExit: a usage error (``--help`` too).
    """
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_member_arguments(ap)
    ap.add_argument("--compute-s", type=float, default=0.02)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--max-steps", type=int, default=1_000_000)
    ap.add_argument("--step-timeout-s", type=float, default=30.0)
    ap.add_argument("--policy-timeout-s", type=float, default=10.0)
    ap.add_argument("--no-policy-notices", action="store_true", help="ask at every boundary")
    ap.add_argument("--daemon-dir", default=None,
                    help="the embedded daemon's run directory (its IPC socket)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.compute_s < 0 or args.width < 1:
        ap.error("--compute-s must be >= 0 and --width >= 1")
    return args


def _model(width: int) -> torch.nn.Sequential:
    """The small MLP every worker trains.

    Args:
        width: Width of its hidden layers.

    Returns:
        The model (64 inputs, 10 outputs).
    """
    return torch.nn.Sequential(
        torch.nn.Linear(64, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    )


def _train(
    trainer: Trainer,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    args: argparse.Namespace,
    out: TextIO,
) -> None:
    """Trains until ``--max-steps`` or an exit request, writing each step's record.

    Before a step's line, the trainer events raised since the previous one are written as
    ``{"trainer_event": KIND, ...}`` lines.

    Args:
        trainer: The member's trainer.
        model: The model it trains.
        opt: The model's optimizer.
        batch: The fixed ``(inputs, labels)`` batch every step trains on.
        args: Gives ``max_steps`` and ``compute_s``.
        out: The open output file (flushed after every step).
    """
    xs, ys = batch
    events = EventTail(trainer)
    while trainer.step < args.max_steps and not capture_exit_event():
        t0 = time.time()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xs), ys).backward()
        if args.compute_s:
            time.sleep(args.compute_s)
        tu = time.time()
        trainer.update()
        trainer.check_state_replication()
        t1 = time.time()
        rec = {"step": trainer.step, "epoch": trainer.epoch, "world": trainer.world_size}
        for ev in events.new():
            write_record(out, {"trainer_event": ev["event"], **ev})
        write_record(out, {**rec, "t0": t0, "tu": tu, "t1": t1})


if __name__ == "__main__":
    sys.exit(main())
