"""A training process for the training-semantics tests: one real member of a cluster.

A copy of ``worker.py`` that exercises what a real training loop needs from ``update()``:

- ``--batch N --weighted``: this device uses ``N`` samples a step and passes
  ``num_samples=N`` (sample-weighted averaging); ``--dump-dir D`` saves, for the first
  ``--dump-count`` steps run with ``--dump-world`` members, the parameters before the step, the
  averaged gradients and the local batch, so a test can recompute the gradient of the
  concatenated batch in one process.
- ``--accum K``: the step's samples go through ``K`` backward passes (gradient accumulation).
- ``--extras``: a real loop's state and hooks: a warmup + cosine ``LambdaLR``, a
  ``torch.amp.GradScaler("cpu")`` and a small EMA of the weights in ``extra_state``; the
  ``before_step`` hook unscales and clips the averaged gradient, ``step_fn`` is
  ``scaler.step(optimizer)`` and ``after_step`` updates the scaler, the scheduler and the EMA.
  The digest then covers the extra states and the learning rate too.
- ``--global-batch G``: a constant global batch; each step uses ``trainer.local_batch_size``
  samples (``--sample-time S`` sleeps ``S`` seconds per sample: a slower device) and records
  the split in force.

It appends one JSON line per step to ``--out``: step, epoch, world size, the local batch size
and a SHA-256 over the model, the optimizer state and the step. ``<out>.leave`` asks it to
leave gracefully at its next step.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from chaos.replication.state import extra_digest
from chaos.trainer.worker import (
    add_member_arguments,
    leave_cluster,
    local_data,
    start_member,
    step_record,
    write_record,
)

ROWS = 512


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_member_arguments(ap)
    ap.add_argument("--max-steps", type=int, default=10_000)
    ap.add_argument("--step-time", type=float, default=0.02)
    ap.add_argument("--batch", type=int, default=8, help="samples per step on this device")
    ap.add_argument("--weighted", action="store_true", help="update(num_samples=batch)")
    ap.add_argument("--accum", type=int, default=1, help="backward passes per update()")
    ap.add_argument("--extras", action="store_true", help="scheduler, scaler, EMA and hooks")
    ap.add_argument("--global-batch", type=int, default=None)
    ap.add_argument("--sample-time", type=float, default=0.0, help="seconds per sample")
    ap.add_argument("--dump-dir", type=Path, default=None)
    ap.add_argument("--dump-world", type=int, default=3)
    ap.add_argument("--dump-count", type=int, default=3)
    ap.add_argument(
        "--die-after", type=int, default=None, help="kill -9 mid-allreduce, N steps after joining"
    )
    return ap.parse_args()


class Ema:
    """A small exponential moving average of a model's parameters."""

    def __init__(self, model: torch.nn.Module, decay: float = 0.9) -> None:
        self.decay = decay
        self.updates = 0
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters()}

    def update(self, model: torch.nn.Module) -> None:
        self.updates += 1
        with torch.no_grad():
            for n, p in model.named_parameters():
                self.shadow[n].mul_(self.decay).add_(p, alpha=1 - self.decay)

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "updates": self.updates, "shadow": dict(self.shadow)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.decay = state["decay"]
        self.updates = state["updates"]
        for n, t in state["shadow"].items():
            self.shadow[n].copy_(t)


def warmup_cosine(step: int, warmup: int = 10, total: int = 200) -> float:
    """The learning-rate factor at ``step``: linear warmup, then a cosine decay to 10%."""
    if step < warmup:
        return (step + 1) / warmup
    done = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * done))


def build_model() -> torch.nn.Module:
    """The small MLP every member trains (the same initial weights everywhere)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def batch_at(xs: torch.Tensor, ys: torch.Tensor, step: int, size: int) -> tuple[Any, Any]:
    """The ``size`` samples this device uses at ``step`` (wrapping around its data)."""
    idx = (torch.arange(size) + step * size) % xs.shape[0]
    return xs[idx], ys[idx]


def main() -> int:
    args = _parse_args()
    model = build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    xs, ys = local_data(args.id, ROWS, 16, 4)
    extra: dict[str, Any] = {}
    hooks: dict[str, Any] = {}
    scaler = None
    if args.extras:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
        scaler = torch.amp.GradScaler("cpu", growth_interval=3)
        ema = Ema(model)
        extra = {"sched": sched, "scaler": scaler, "ema": ema}

        def before_step() -> None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)

        def after_step() -> None:
            scaler.update()
            sched.step()
            ema.update(model)

        hooks = {
            "before_step": before_step,
            "step_fn": lambda: scaler.step(opt),
            "after_step": after_step,
        }
    trainer = start_member(args, model, opt, step_timeout_s=20.0, extra_state=extra,
                           global_batch=args.global_batch)  # fmt: skip
    if args.die_after is not None:
        trainer.fail_at(trainer.step + args.die_after)
    dumped = 0
    leave_flag = args.out.with_suffix(".leave")
    with args.out.open("a") as out:
        write_record(out, {"ready": True, "step": trainer.step, "epoch": trainer.epoch})
        while trainer.step < args.max_steps and not leave_flag.exists():
            step = trainer.step
            size = trainer.local_batch_size or args.batch
            x, y = batch_at(xs, ys, step, size)
            opt.zero_grad()
            for xm, ym in zip(x.chunk(args.accum), y.chunk(args.accum), strict=False):
                # each micro-batch's share of the mean loss over the step's samples
                loss = torch.nn.functional.cross_entropy(model(xm), ym, reduction="sum")
                loss = loss / size
                (scaler.scale(loss) if scaler is not None else loss).backward()
            time.sleep(args.step_time + args.sample_time * size)  # a longer forward/backward
            before = [p.detach().clone() for p in model.parameters()]
            weighted = args.weighted or args.global_batch is not None
            entries = sum(1 for e in trainer.events if e["event"] == "entered")
            trainer.update(num_samples=size if weighted else None, **hooks)
            # a catching-up joiner's entering update takes no live step: not its own gradient
            entered = sum(1 for e in trainer.events if e["event"] == "entered") > entries
            stepped = trainer.step == step + 1 and not entered
            if (stepped and args.dump_dir is not None and dumped < args.dump_count
                    and trainer.world_size == args.dump_world):  # fmt: skip
                dumped += 1
                args.dump_dir.mkdir(parents=True, exist_ok=True)
                grads = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
                final = args.dump_dir / f"{args.id}-{step}.pt"
                part = final.with_suffix(".part")  # the test reads *.pt: never a half-written one
                torch.save({"params": before, "grads": grads, "x": x, "y": y}, part)
                part.replace(final)
            trainer.check_state_replication()
            rec = step_record(trainer, model, opt, batch=size, split=trainer.batch_sizes)
            if args.extras:
                rec["lr"] = opt.param_groups[0]["lr"]
                rec["scale"] = scaler.get_scale() if scaler is not None else None
                rec["digest"] += extra_digest(extra) + repr(rec["lr"])
            write_record(out, rec)
        leave_cluster(trainer, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
