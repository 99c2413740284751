"""A training process for the non-finite gradient tests: one real member of a cluster.

Run as ``python finite_worker.py --id a --listen tcp://127.0.0.1:P [--join ...] --out F``. It
trains a small MLP on its own data and appends one JSON line per step (step, world, digest, whether
every parameter and optimizer state tensor is finite). ``--poison STEP:KIND`` spoils this device's
own gradients once, in the first ``update()`` at or after ``STEP`` while the world holds
``--poison-world`` members: ``nan`` (every element), ``inf`` (one element) or ``scale`` (every
gradient multiplied by 1e30). ``--poison-from STEP:KIND`` spoils them in that same first
``update()`` and in every one after it (a broken device), and ``--exit-when-evicted`` ends the
worker once the scheduler evicted its trainer. ``--poison-when-serving KIND`` spoils them once, in
the first ``update()`` after this member started serving a catching-up joiner (its step log then
holds a skipped step). The trainer's events named in :data:`RECORDED` are recorded; a
:class:`~chaos.errors.NonFiniteGradient` (``--nonfinite raise``) is recorded and ends the worker.
``<out>.leave`` asks it to leave at its next step.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

import torch

from chaos.errors import NonFiniteGradient
from chaos.trainer.trainer import Trainer
from chaos.trainer.worker import (
    add_member_arguments,
    leave_cluster,
    local_data,
    start_member,
    step_record,
    write_record,
)


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_member_arguments(ap)
    ap.add_argument("--max-steps", type=int, default=10_000)
    ap.add_argument("--step-time", type=float, default=0.02)
    ap.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    ap.add_argument("--nonfinite", default="skip", help="TrainerConfig.nonfinite")
    ap.add_argument("--max-grad-norm", type=float, default=None,
                    help="TrainerConfig.max_grad_norm")  # fmt: skip
    ap.add_argument("--poison", default=None, help="STEP:KIND, KIND one of nan, inf, scale")
    ap.add_argument("--poison-world", type=int, default=3)
    ap.add_argument("--poison-from", default=None,
                    help="STEP:KIND, like --poison, then at every update after it")
    ap.add_argument("--poison-when-serving", default=None,
                    help="KIND, once, when this member starts serving a catching-up joiner")
    ap.add_argument("--exit-when-evicted", action="store_true")
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--daemon-dir", default=None, help="the embedded daemon's run directory")
    ap.add_argument("--join-mode", choices=["catch-up", "barrier"], default="catch-up")
    return ap.parse_args()


RECORDED = ("nonfinite_gradient", "evicted", "serving", "snapshot_pulled", "replayed", "entered")
"""The trainer events a worker records (without their time)."""


def _spoil(model: torch.nn.Module, kind: str) -> None:
    """Spoils this device's gradients, as fp16 overflow or a corrupt batch would."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if kind == "nan":
        for g in grads:
            g.fill_(float("nan"))
    elif kind == "inf":
        grads[0].view(-1)[3] = float("inf")
    elif kind == "scale":
        for g in grads:
            g.mul_(1e30)
    else:
        raise ValueError(f"unknown poison {kind!r}")


def _finite(model: torch.nn.Module, opt: torch.optim.Optimizer) -> bool:
    tensors = [p.detach() for p in model.parameters()]
    for state in opt.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def main() -> int:
    args = _parse_args()
    torch.manual_seed(0)
    w = args.width
    model = torch.nn.Sequential(torch.nn.Linear(16, w), torch.nn.ReLU(), torch.nn.Linear(w, 4))
    opt: torch.optim.Optimizer
    if args.optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    xs, ys = local_data(args.id, 256, 16, 4)
    trainer = start_member(args, model, opt, step_timeout_s=20.0, nonfinite=args.nonfinite,
                           max_grad_norm=args.max_grad_norm, daemon_dir=args.daemon_dir,
                           join_mode=args.join_mode)  # fmt: skip
    poison_step, kind = (int(args.poison.split(":")[0]), args.poison.split(":")[1]) \
        if args.poison else (None, "")  # fmt: skip
    broken_from, broken_kind = (int(args.poison_from.split(":")[0]),
                                args.poison_from.split(":")[1]) \
        if args.poison_from else (None, "")  # fmt: skip
    serving_kind = args.poison_when_serving
    seen, serving, broken = 0, False, False
    leave_flag = args.out.with_suffix(".leave")
    with args.out.open("a") as out:
        write_record(out, {"ready": True, "step": trainer.step, "epoch": trainer.epoch})
        while trainer.step < args.max_steps and not leave_flag.exists():
            i = trainer.step % 32
            opt.zero_grad()
            x, y = xs[i * 8 : i * 8 + 8], ys[i * 8 : i * 8 + 8]
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            time.sleep(args.step_time)
            if (poison_step is not None and trainer.step >= poison_step
                    and trainer.world_size == args.poison_world):  # fmt: skip
                _spoil(model, kind)
                write_record(out, {"poisoned": kind, "step": trainer.step})
                poison_step = None
            if broken_from is not None and trainer.step >= broken_from and (
                    broken or trainer.world_size == args.poison_world):  # fmt: skip
                broken = True
                _spoil(model, broken_kind)
                write_record(out, {"poisoned": broken_kind, "step": trainer.step})
            if serving and serving_kind is not None:
                _spoil(model, serving_kind)
                write_record(out, {"poisoned": serving_kind, "step": trainer.step})
                serving_kind = None
            try:
                trainer.update()
            except NonFiniteGradient as exc:
                write_record(out, {"raised": str(exc), "step": exc.step,
                                   "devices": list(exc.devices),
                                   **step_record(trainer, model, opt)})  # fmt: skip
                trainer.close()
                return 0
            trainer.check_state_replication()
            evicted = False
            for e in trainer.events[seen:]:
                if e["event"] in RECORDED:
                    write_record(out, {k: v for k, v in e.items() if k != "t"})
                serving = serving or (e["event"] == "serving" and bool(e.get("catch_up")))
                evicted = evicted or e["event"] == "evicted"
            seen = len(trainer.events)
            if evicted and args.exit_when_evicted:
                return _exit_evicted(trainer, out, model, opt)
            write_record(out, step_record(trainer, model, opt, finite=_finite(model, opt),
                                          offences=trainer.nonfinite_offences))  # fmt: skip
        leave_cluster(trainer, out)
    return 0


def _exit_evicted(trainer: Trainer, out: TextIO, model: torch.nn.Module,
                  opt: torch.optim.Optimizer) -> int:  # fmt: skip
    """Ends a worker whose trainer the scheduler evicted (it joined again meanwhile)."""
    write_record(out, {"exited_evicted": True, **step_record(trainer, model, opt)})
    leave_cluster(trainer, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
