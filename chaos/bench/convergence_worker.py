"""One member of ``chaos-bench convergence``: trains a small MLP on scikit-learn's digits.

The launcher (:mod:`chaos.bench.convergence`) starts it as
``python -m chaos.bench.convergence_worker`` with the member arguments every worker shares
(:func:`chaos.trainer.worker.add_member_arguments`) and these:

- ``--go FILE``: a joiner is started ahead of its join (torch imported, data loaded) and joins
  when the launcher creates ``FILE``, so that a join scripted at a step lands near that step.
- ``--initial N``: a member of the run's first membership waits, serving joiners, until ``N``
  members are in before its first step, so that a static run is static from step 0.
- ``--global-batch G`` (the constant global batch: ``trainer.local_batch_size`` samples a step,
  split by the scheduler) or ``--local-batch B`` (a fixed batch per device).
- ``--evaluate``: this member (the founder, never killed) writes one record a step (step,
  seconds since the first step, members, its batch) and, every ``--eval-every`` steps and at
  the last, the test split's loss and accuracy. Every member's model is bitwise equal.

Each step sleeps ``--sample-time`` seconds per sample: the device's compute, so that a step's
time grows with its samples as on a real device. SIGTERM is a graceful leave at the next step
boundary (``request_node_exit``). It writes ``ready``, ``left`` and ``done`` records to
``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from chaos.bench.convergence import SKLEARN_HINT
from chaos.launch import wait_until
from chaos.trainer import Trainer, capture_exit_event
from chaos.trainer.worker import add_member_arguments, start_member, write_record

TEST_FRACTION = 0.2
"""The share of the digits held out as the test split (the same split in every run)."""


def load_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The digits as flat features in [0, 1]: a fixed train and test split.

    Returns:
        ``(x_train, y_train, x_test, y_test)``; inputs are ``(n, 64)`` floats.

    Raises:
        SystemExit: scikit-learn is not installed (the message names the extra to install).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise SystemExit(SKLEARN_HINT) from exc
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    n_test = int(len(y) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def make_model() -> nn.Module:
    """A small MLP, 64 -> 64 -> 10."""
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="chaos.bench.convergence_worker")
    add_member_arguments(ap)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--eval-every", type=int, required=True)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--sample-time", type=float, required=True, help="seconds per sample")
    ap.add_argument("--timeout", type=float, required=True, help="seconds allowed per wait")
    batch = ap.add_mutually_exclusive_group(required=True)
    batch.add_argument("--global-batch", type=int, default=None)
    batch.add_argument("--local-batch", type=int, default=None)
    ap.add_argument("--go", type=Path, default=None, help="join once this file exists")
    ap.add_argument("--go-timeout", type=float, default=600.0, help="seconds to wait for it")
    ap.add_argument("--initial", type=int, default=1, help="members before the first step")
    ap.add_argument("--evaluate", action="store_true", help="record steps and test metrics")
    return ap.parse_args(argv)


def _gather(trainer: Trainer, size: int, timeout_s: float) -> None:
    """Serves joiners at step 0 until the run's first membership is complete."""

    def complete() -> bool:
        trainer.check_state_replication()  # installs a newer policy, serves a joiner
        return trainer.world_size >= size

    wait_until(complete, timeout_s, f"{size} members before the first step", poll_s=0.02)


class _Evaluator:
    """The test split's loss and accuracy, and the step records of the evaluating member."""

    def __init__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, out: TextIO) -> None:
        self.model, self.x, self.y, self.out = model, x, y, out
        self.t0 = time.time()

    def record(self, trainer: Trainer, batch: int, metrics: bool) -> None:
        rec: dict[str, Any] = {"step": trainer.step, "wall_s": time.time() - self.t0,
                               "members": trainer.world_size, "batch": batch}  # fmt: skip
        if metrics:
            with torch.no_grad():
                logits = self.model(self.x)
                rec["loss"] = nn.functional.cross_entropy(logits, self.y).item()
                rec["accuracy"] = (logits.argmax(1) == self.y).float().mean().item()
        write_record(self.out, rec)


def _train(
    args: argparse.Namespace,
    trainer: Trainer,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    data: tuple[torch.Tensor, ...],
    out: TextIO,
) -> int:
    """Trains until ``--steps`` (or a graceful leave); returns the exit code."""
    x, y, x_test, y_test = data
    index = int("".join(c for c in args.id if c.isdigit()) or 0)
    batches = torch.Generator().manual_seed(args.seed * 1000 + index)
    ev = _Evaluator(model, x_test, y_test, out) if args.evaluate else None
    if ev is not None:
        ev.record(trainer, 0, metrics=True)
    while trainer.step < args.steps:
        n = trainer.local_batch_size if args.global_batch else args.local_batch
        if n is None:
            raise RuntimeError("no batch size: neither --global-batch nor --local-batch")
        idx = torch.randint(0, len(y), (n,), generator=batches)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        time.sleep(args.sample_time * n)  # the device's compute per sample
        trainer.update(num_samples=n)
        trainer.check_state_replication()
        if ev is not None:
            step = trainer.step
            ev.record(trainer, n, metrics=step % args.eval_every == 0 or step >= args.steps)
        if capture_exit_event():  # SIGTERM from the launcher: a graceful leave
            trainer.request_node_exit()
            write_record(out, {"kind": "left", "step": trainer.step})
            return 0
    write_record(out, {"kind": "done", "step": trainer.step})
    trainer.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Runs one member; returns its exit code."""
    args = _parse(argv)
    capture_exit_event()  # from now on SIGTERM asks for a graceful leave
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)  # the founder's model is the run's; a joiner's is replaced
    data = load_split()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if args.go is not None:
        go: Path = args.go
        wait_until(lambda: go.exists() or capture_exit_event(), args.go_timeout, f"{go}")
        if not go.exists():
            return 0  # asked to stop before it joined
    trainer = start_member(
        args, model, opt, step_timeout_s=30.0, stall_timeout_s=args.timeout,
        join_timeout_s=args.timeout, global_batch=args.global_batch,
    )  # fmt: skip
    with args.out.open("a") as out:
        write_record(out, {"kind": "ready", "step": trainer.step})
        if args.initial > 1:
            _gather(trainer, args.initial, args.timeout)
        return _train(args, trainer, model, opt, data, out)


if __name__ == "__main__":
    sys.exit(main())
