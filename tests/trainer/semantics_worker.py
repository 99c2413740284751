"""A training process for the training-semantics tests: one real member of a cluster.

A copy of ``worker.py`` that exercises what a real training loop needs from ``update()``:

- ``--batch N --weighted``: this device uses ``N`` samples a step and passes
  ``num_samples=N`` (sample-weighted averaging); ``--dump-dir D`` saves, for the first
  ``--dump-count`` steps run with ``--dump-world`` members, the parameters before the step, the
  averaged gradients and the local batch, so a test can recompute the gradient of the
  concatenated batch in one process.
- ``--accum K``: the step's samples go through ``K`` backward passes (gradient accumulation).

It appends one JSON line per step to ``--out``: step, epoch, world size, the local batch size
and a SHA-256 over the model, the optimizer state and the step. ``<out>.leave`` asks it to
leave gracefully at its next step.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path
from typing import Any

import torch

from chaos.trainer.worker import add_member_arguments, local_data, start_member, write_record

ROWS = 512


def state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> str:
    """SHA-256 over parameters, buffers, optimizer state tensors and the step."""
    h = hashlib.sha256(str(step).encode())
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, v in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(v, torch.Tensor):
                    h.update(key.encode())
                    h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_member_arguments(ap)
    ap.add_argument("--max-steps", type=int, default=10_000)
    ap.add_argument("--step-time", type=float, default=0.02)
    ap.add_argument("--batch", type=int, default=8, help="samples per step on this device")
    ap.add_argument("--weighted", action="store_true", help="update(num_samples=batch)")
    ap.add_argument("--accum", type=int, default=1, help="backward passes per update()")
    ap.add_argument("--dump-dir", type=Path, default=None)
    ap.add_argument("--dump-world", type=int, default=3)
    ap.add_argument("--dump-count", type=int, default=3)
    ap.add_argument(
        "--die-after", type=int, default=None, help="kill -9 mid-allreduce, N steps after joining"
    )
    return ap.parse_args()


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
    trainer = start_member(args, model, opt, step_timeout_s=20.0)
    if args.die_after is not None:
        trainer.fail_at(trainer.step + args.die_after)
    dumped = 0
    leave_flag = args.out.with_suffix(".leave")
    with args.out.open("a") as out:
        write_record(out, {"ready": True, "step": trainer.step, "epoch": trainer.epoch})
        while trainer.step < args.max_steps:
            step = trainer.step
            x, y = batch_at(xs, ys, step, args.batch)
            opt.zero_grad()
            for xm, ym in zip(x.chunk(args.accum), y.chunk(args.accum), strict=True):
                # each micro-batch's share of the mean loss over the step's samples
                loss = torch.nn.functional.cross_entropy(model(xm), ym, reduction="sum")
                (loss / args.batch).backward()
            time.sleep(args.step_time)  # stands in for a longer forward/backward pass
            before = [p.detach().clone() for p in model.parameters()]
            trainer.update(num_samples=args.batch if args.weighted else None)
            stepped = trainer.step == step + 1
            if (stepped and args.dump_dir is not None and dumped < args.dump_count
                    and trainer.world_size == args.dump_world):  # fmt: skip
                dumped += 1
                args.dump_dir.mkdir(parents=True, exist_ok=True)
                grads = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
                torch.save({"params": before, "grads": grads, "x": x, "y": y},
                           args.dump_dir / f"{args.id}-{step}.pt")  # fmt: skip
            trainer.check_state_replication()
            rec = {
                "step": trainer.step,
                "epoch": trainer.epoch,
                "world": trainer.world_size,
                "batch": args.batch,
                "digest": state_digest(model, opt, trainer.step),
            }
            write_record(out, rec)
            if leave_flag.exists():
                trainer.request_node_exit()
                write_record(out, {"left": True, "step": trainer.step})
                return 0
        trainer.request_node_exit()
        write_record(out, {"left": True, "step": trainer.step})
    return 0


if __name__ == "__main__":
    sys.exit(main())
