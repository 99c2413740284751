"""A training process for the Trainer integration tests: one real member of a cluster.

Run as ``python worker.py --id a --listen tcp://127.0.0.1:P [--join tcp://...] --out F``.
It trains a small MLP on its own local data (seeded by its id) and appends one JSON line per
step to ``--out``: the step, epoch, world size and a SHA-256 over the model parameters, the
optimizer state and the step, so a test can check the members are bitwise equal. The test
drives it through files: ``<out>.leave`` asks it to leave gracefully at its next step.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from chaos.trainer.worker import (
    add_member_arguments,
    leave_cluster,
    local_data,
    start_member,
    step_record,
    write_record,
)

_RECORDED = {
    "waiting": ("waited_s", "paused"),
    "evicted": (),
    "rejoined": (),
    "snapshot_pulled": ("step", "planned_step", "t"),
    "replayed": ("step", "replayed", "lag", "why", "t"),
    "entered": ("step", "replayed", "pulled_bytes", "state_bytes", "t"),
    "serving": ("joiner", "step", "catch_up", "t"),
    "snapshot_failed": ("epoch", "t"),
    "entry_failed": ("epoch", "t"),
    "join_again_failed": ("attempt", "t"),
    "phase": ("phase", "previous", "step", "t"),
}
"""The trainer events a worker records, with the fields it keeps."""


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_member_arguments(ap)
    ap.add_argument("--max-steps", type=int, default=10_000)
    ap.add_argument("--more-steps", type=int, default=None,
                    help="stop this many steps after joining (instead of at --max-steps)")
    ap.add_argument("--step-time", type=float, default=0.02)
    ap.add_argument("--optimizer", choices=["sgd", "adam", "adamw"], default="sgd",
                    help="adamw: two parameter groups (weights decay, biases do not), nanoGPT's")
    ap.add_argument("--lr-from-step", action="store_true",
                    help="before each update(), set every group's lr from trainer.step "
                    "(warmup, then cosine decay), as nanoGPT's loop does")
    ap.add_argument("--clip", type=float, default=None,
                    help="clip the local gradient's norm to this before update()")
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--daemon-dir", default=None, help="the embedded daemon's run directory")
    ap.add_argument("--cluster-key", default=None, help="the cluster key file")
    ap.add_argument(
        "--stall-progress",
        type=float,
        default=10.0,
        help="how often a waiting step reports (its 'waiting' events are recorded)",
    )
    ap.add_argument(
        "--die-after", type=int, default=None, help="kill -9 mid-allreduce, N steps after joining"
    )
    ap.add_argument(
        "--die-serving-after",
        type=int,
        default=None,
        help="kill -9 of the device at a joiner's shard request, once N shards were served",
    )
    ap.add_argument("--join-mode", choices=["catch-up", "barrier"], default="catch-up")
    ap.add_argument(
        "--catch-up-log-bytes", type=int, default=1 << 30, help="TrainerConfig.catch_up_log_bytes"
    )
    ap.add_argument("--max-early-bytes", type=int, default=None,
                    help="TrainerConfig.max_early_bytes")
    ap.add_argument("--wire-dtype", default=None, help="TrainerConfig.wire_dtype")
    ap.add_argument("--audit-every", type=int, default=200, help="TrainerConfig.audit_every")
    return ap.parse_args()


def _build(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial model everywhere; a joiner's is replaced anyway
    model = torch.nn.Sequential(
        torch.nn.Linear(16, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 4)
    )
    if args.optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    elif args.optimizer == "adamw":
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=1e-3, betas=(0.9, 0.95))  # fmt: skip
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, opt


def get_lr(step: int, warmup: int = 10, decay_steps: int = 2000) -> float:
    """nanoGPT's schedule: linear warmup, then cosine decay to a tenth (a new value every step)."""
    top, low = 1e-3, 1e-4
    if step < warmup:
        return top * (step + 1) / warmup
    ratio = min(1.0, (step - warmup) / (decay_steps - warmup))
    return low + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (top - low)


def main() -> int:
    args = _parse_args()
    model, opt = _build(args)
    xs, ys = local_data(args.id, 256, 16, 4)  # this device's local data
    trainer = start_member(args, model, opt, step_timeout_s=20.0, daemon_dir=args.daemon_dir,
                           stall_progress_s=args.stall_progress,
                           cluster_key=args.cluster_key, join_mode=args.join_mode,
                           catch_up_log_bytes=args.catch_up_log_bytes,
                           max_early_bytes=args.max_early_bytes,
                           wire_dtype=args.wire_dtype, audit_every=args.audit_every)  # fmt: skip
    seen = 0
    if args.die_after is not None:
        trainer.fail_at(trainer.step + args.die_after)
    if args.die_serving_after is not None:
        trainer.fail_serving_after(args.die_serving_after)
    leave_flag = args.out.with_suffix(".leave")
    if args.more_steps is not None:
        args.max_steps = trainer.step + args.more_steps
    with args.out.open("a") as out:
        write_record(out, {"ready": True, "step": trainer.step, "epoch": trainer.epoch})
        while trainer.step < args.max_steps and not leave_flag.exists():
            i = trainer.step % 32
            x, y = xs[i * 8 : i * 8 + 8], ys[i * 8 : i * 8 + 8]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            time.sleep(args.step_time)  # stands in for a longer forward/backward pass
            if args.lr_from_step:  # the loop reads the step before update(), as nanoGPT's does
                for group in opt.param_groups:
                    group["lr"] = get_lr(trainer.step)
            if args.clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            trainer.update()
            trainer.check_state_replication()
            for e in trainer.events[seen:]:
                if e["event"] in _RECORDED:
                    kept = {k: v for k, v in e.items() if k in _RECORDED[e["event"]]}
                    write_record(out, {"event": e["event"], **kept})
            seen = len(trainer.events)
            write_record(out, step_record(trainer, model, opt, loss=float(loss.detach()),
                                           lr=opt.param_groups[0]["lr"]))
        leave_cluster(trainer, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
