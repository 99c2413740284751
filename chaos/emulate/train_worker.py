"""One device of ``chaos-emulate train``: ``python -m chaos.emulate.train_worker ...``.

The benchmark (:mod:`chaos.emulate.train_bench_run`) starts one per device, inside the device's
network namespace and CPU budget. It trains a real model (:mod:`chaos.emulate.train_models`)
on its own batches with one torch thread, in one of the modes:

- ``single``: a plain torch loop, no Chaos at all;
- ``sync`` / ``sync-int8``: a :class:`chaos.trainer.Trainer` (int8 on the wire), every step;
- ``local`` / ``local-int8``: :class:`chaos.trainer.LocalSteps` (DiLoCo style).

Every member stops at the same (outer) step, planned from the run's cluster-wide sample budget,
so that none waits for another that left. Device 0 founds the cluster and waits until every
device joined before its first step; in local modes its first inner phase is a single step, so
that the joiners, which enter the members' current outer round with weight 0, start their
first phase with it. Device ``--slow-factor`` > 1 sleeps after each step's compute, so that its
steps take that many times as long (counted as compute: it emulates a slower device).

It appends JSON lines to ``--out``: ``ready``; ``start`` (device 0: the clock starts);
``progress`` at each (outer) step (its own samples, its wall and compute seconds); device 0's
``eval`` (the held-out loss, at each outer boundary in local modes, every
``--eval-every-samples`` cluster samples otherwise); ``done``. Wall seconds exclude device 0's
evaluation time.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

import torch

from chaos.emulate.train_models import Batches, build_model, eval_batch, load_data, loss_of
from chaos.launch import wait_until
from chaos.trainer import LocalSteps, LocalStepsConfig, Trainer
from chaos.trainer.worker import add_member_arguments, write_record

MODES = ("single", "sync", "sync-int8", "local", "local-int8")
"""The benchmark's modes."""
GATHER_POLL_S = 0.02


def planned_steps(mode: str, samples: int, world: int, batch: int, inner_steps: int) -> int:
    """The (outer) steps every member takes: the sample budget over the cluster's samples per
    step (``world * batch``; times ``inner_steps`` for an outer step), rounded up; in local
    modes with several devices, one more: the first outer step is device 0's single inner
    step, which the joiners enter with weight 0."""
    local = mode.startswith("local")
    per_step = world * batch * (inner_steps if local else 1)
    return max(1, math.ceil(samples / per_step)) + (1 if local and world > 1 else 0)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="chaos.emulate.train_worker")
    add_member_arguments(ap)
    ap.add_argument("--mode", choices=MODES, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--samples", type=int, required=True, help="the cluster's sample budget")
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--inner-steps", type=int, default=32)
    ap.add_argument("--inner-time-s", type=float, default=None)
    ap.add_argument("--overlap", action="store_true")
    ap.add_argument("--outer-lr", type=float, default=1.0)
    ap.add_argument("--outer-momentum", type=float, default=0.0)
    ap.add_argument("--eval-every-samples", type=int, required=True)
    ap.add_argument("--eval-samples", type=int, required=True)
    ap.add_argument("--slow-factor", type=float, default=1.0)
    ap.add_argument("--host", default=None)
    ap.add_argument("--cluster-key", default=None)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per wait")
    return ap.parse_args(argv)


@dataclass
class _Clock:
    """A device's wall clock, compute time and evaluation time (all seconds)."""

    t0: float = 0.0
    compute_s: float = 0.0
    eval_s: float = 0.0
    samples: int = 0

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def wall_s(self) -> float:
        """Seconds since the start, less the evaluations'."""
        return time.perf_counter() - self.t0 - self.eval_s


class _Device:
    """The model, its data and the timing of one device's loop."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        torch.set_num_threads(1)
        data = load_data(args.model)
        self.model = build_model(args.model, data.vocab, args.seed)  # equal on every device
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        self.batches = Batches(args.model, data, args.batch, args.seed, args.rank)
        self.eval_x, self.eval_y = eval_batch(args.model, data, args.eval_samples)
        self.clock = _Clock()
        self.global_snapshot: list[torch.Tensor] | None = None
        """Local modes: the global parameters after the latest outer step (taken on the outer
        step's thread with overlap), which device 0 evaluates."""

    def compute(self) -> None:
        """One step's forward and backward (and the slow device's sleep)."""
        x, y = self.batches.next()
        t = time.perf_counter()
        self.opt.zero_grad(set_to_none=False)
        loss_of(self.args.model, self.model, x, y).backward()
        dt = time.perf_counter() - t
        if self.args.slow_factor > 1:
            time.sleep(dt * (self.args.slow_factor - 1))  # emulates a slower device
        self.clock.compute_s += time.perf_counter() - t
        self.clock.samples += self.args.batch

    def optimizer_step(self) -> None:
        """The (inner) optimizer step, timed as compute."""
        t = time.perf_counter()
        self.opt.step()
        self.clock.compute_s += time.perf_counter() - t

    def evaluate(self, out: TextIO, step: int) -> None:
        """Device 0: the held-out loss now (in local modes, of the latest global parameters),
        recorded; its time is not counted as wall time."""
        t = time.perf_counter()
        model = self.model
        if self.global_snapshot is not None:
            model = copy.deepcopy(self.model)
            with torch.no_grad():
                for p, g in zip(model.parameters(), self.global_snapshot, strict=True):
                    p.copy_(g)
        model.eval()
        with torch.no_grad():
            loss = loss_of(self.args.model, model, self.eval_x, self.eval_y).item()
        model.train()
        dt = time.perf_counter() - t
        self.clock.eval_s += dt
        write_record(out, {"kind": "eval", "step": step, "own_samples": self.clock.samples,
                           "wall_s": self.clock.wall_s(), "loss": loss, "eval_s": dt})  # fmt: skip

    def progress(self, out: TextIO, step: int) -> None:
        """This device's totals at (outer) step ``step``."""
        c = self.clock
        write_record(out, {"kind": "progress", "step": step, "samples": c.samples,
                           "wall_s": c.wall_s(), "compute_s": c.compute_s})  # fmt: skip


def _member(args: argparse.Namespace, dev: _Device) -> Trainer | LocalSteps | None:
    """The mode's Chaos member (``None`` in ``single``), joined or founded."""
    if args.mode == "single":
        return None
    options: dict[str, Any] = {
        "join": args.join, "node_id": args.id, "listen": args.listen,
        "daemon_args": tuple(args.daemon_arg), "host": args.host,
        "cluster_key": args.cluster_key, "join_timeout_s": args.timeout,
        "step_timeout_s": args.timeout, "stall_timeout_s": args.timeout,
    }  # fmt: skip
    if args.mode.endswith("int8"):
        options["wire_dtype"] = "int8"
    if args.mode.startswith("sync"):
        return Trainer(dev.model, dev.opt, **options)
    local = LocalStepsConfig(args.inner_steps, args.inner_time_s, outer_lr=args.outer_lr,
                             outer_momentum=args.outer_momentum,
                             outer_nesterov=args.outer_momentum > 0, overlap=args.overlap)
    holder: list[LocalSteps] = []

    def snapshot() -> None:  # the global state right after each outer step, for device 0
        if holder and args.rank == 0:
            dev.global_snapshot = [p.detach().clone() for p in holder[0].global_params.params]

    member = LocalSteps(dev.model, dev.opt, local=local, after_outer_step=snapshot, **options)
    holder.append(member)
    return member


def _gather(member: Trainer | LocalSteps, size: int, timeout_s: float) -> None:
    """Device 0 serves joiners until all ``size`` devices are members.

    Raises:
        ChaosTimeout: fewer members after ``timeout_s``.
    """

    def complete() -> bool:
        member.check_state_replication()  # installs a newer policy, serves a joiner
        return member.world_size >= size

    wait_until(complete, timeout_s, f"{size} members before the first step", poll_s=GATHER_POLL_S)


def _train_single(args: argparse.Namespace, dev: _Device, out: TextIO, steps: int) -> None:
    """The plain torch loop: no Chaos."""
    next_eval = args.eval_every_samples
    for step in range(1, steps + 1):
        dev.compute()
        dev.optimizer_step()
        dev.progress(out, step)
        if dev.clock.samples >= next_eval or step == steps:
            dev.evaluate(out, step)
            next_eval += args.eval_every_samples


def _train_sync(args: argparse.Namespace, dev: _Device, member: Trainer, out: TextIO,
                steps: int) -> None:  # fmt: skip
    """The Trainer's loop: an allreduce every step."""
    next_eval = args.eval_every_samples
    while member.step < steps:
        dev.compute()
        member.update(num_samples=args.batch, step_fn=dev.optimizer_step)
        member.check_state_replication()
        step = member.step
        dev.progress(out, step)
        cluster = step * args.world * args.batch  # the planned count; the runner sums records
        if args.rank == 0 and (cluster >= next_eval or step >= steps):
            dev.evaluate(out, step)
            while next_eval <= cluster:
                next_eval += args.eval_every_samples


def _train_local(args: argparse.Namespace, dev: _Device, member: LocalSteps, out: TextIO,
                 steps: int) -> None:  # fmt: skip
    """LocalSteps' loop: device 0 evaluates the global parameters at every outer boundary.
    Device 0's first phase is one inner step (the joiners wait in the members' round)."""
    first = member.local_config
    if args.rank == 0 and args.world > 1:
        member.local_config = replace(first, inner_steps=1, inner_time_s=None)
    while member.step < steps:
        dev.compute()
        boundary = member.update(num_samples=args.batch, step_fn=dev.optimizer_step)
        member.check_state_replication()
        if boundary:
            member.local_config = first
            dev.progress(out, member.step)
            if args.rank == 0:
                dev.evaluate(out, member.step)


def main(argv: list[str] | None = None) -> int:
    """Runs one device; returns its exit code."""
    args = _parse(argv)
    dev = _Device(args)
    steps = planned_steps(args.mode, args.samples, args.world, args.batch, args.inner_steps)
    member = _member(args, dev)
    try:
        with Path(args.out).open("a") as out:
            write_record(out, {"kind": "ready", "rank": args.rank, "steps": steps})
            if member is not None and args.rank == 0 and args.world > 1:
                _gather(member, args.world, args.timeout)
            dev.clock.start()
            if args.rank == 0:
                write_record(out, {"kind": "start", "t": time.time()})
                dev.evaluate(out, 0)
            if member is None:
                _train_single(args, dev, out, steps)
            elif isinstance(member, LocalSteps):
                _train_local(args, dev, member, out, steps)
            else:
                _train_sync(args, dev, member, out, steps)
            c = dev.clock
            write_record(out, {"kind": "done", "samples": c.samples, "wall_s": c.wall_s(),
                               "compute_s": c.compute_s, "eval_s": c.eval_s})  # fmt: skip
    finally:
        if member is not None:
            member.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
