"""A training process for the state audit's test: one real member that may flip a bit.

Run as ``python audit_worker.py --id a --listen tcp://127.0.0.1:P [--join ...] --out F
[--audit-every N]``. The test drives it through files: ``<out>.flip`` flips one bit of one of
its parameters (:meth:`Trainer.flip_bit_at`) at its next step, ``<out>.leave`` ends it. It
trains a small MLP with Adam on its own local data and appends one JSON line per step (step,
world size, a digest of its model and optimizer state), one per audit event
(``bit_flipped``, ``state_diverged``, ``state_healed``) and, at the end, its audit record.
"""

from __future__ import annotations

import argparse
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

_EVENTS = ("bit_flipped", "state_diverged", "state_healed", "evicted", "ready")


def main() -> int:
    ap = argparse.ArgumentParser()
    add_member_arguments(ap)
    ap.add_argument("--max-steps", type=int, default=100_000)
    ap.add_argument("--audit-every", type=int, default=5)
    ap.add_argument("--step-time", type=float, default=0.02)
    args = ap.parse_args()
    torch.manual_seed(0)
    # wide enough that the state spans several 256 KiB chunks (about 1 MiB with Adam's)
    model = torch.nn.Sequential(torch.nn.Linear(16, 4096), torch.nn.ReLU(),
                                torch.nn.Linear(4096, 4))  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    xs, ys = local_data(args.id, 256, 16, 4)
    trainer = start_member(args, model, opt, step_timeout_s=20.0, audit_every=args.audit_every)
    seen, armed = 0, False
    leave_flag, flip_flag = args.out.with_suffix(".leave"), args.out.with_suffix(".flip")
    with args.out.open("a") as out:
        while trainer.step < args.max_steps and not leave_flag.exists():
            if not armed and flip_flag.exists():
                trainer.flip_bit_at(trainer.step + 1, param=0, element=3, bit=20)
                armed = True
            i = trainer.step % 32
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xs[i * 8 : i * 8 + 8]),
                                                     ys[i * 8 : i * 8 + 8])  # fmt: skip
            loss.backward()
            time.sleep(args.step_time)
            trainer.update()
            trainer.check_state_replication()
            for e in trainer.events[seen:]:
                if e["event"] in _EVENTS:
                    write_record(out, {k: v for k, v in e.items() if k not in ("t", "node")})
            seen = len(trainer.events)
            write_record(out, step_record(trainer, model, opt))
        write_record(out, {"audit": trainer.audit})
        leave_cluster(trainer, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
