"""A training process for the stall test: trains until ``update()`` raises, then records it.

Run as ``python stall_worker.py --id a --listen tcp://127.0.0.1:P [--join tcp://...] --out F``.
It appends JSON lines to ``--out``: ``{"ready": ..., "daemon_pid": ...}`` once it is a member
(the pid of its embedded daemon, so that a test can pause it), one ``{"step", "world"}`` line
per step, and, when ``update()`` raises, ``{"error": <class name>, "bases": [...]}`` before it
exits with code 3.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from chaos.trainer.worker import add_member_arguments, local_data, start_member, write_record


def main() -> int:
    ap = argparse.ArgumentParser()
    add_member_arguments(ap)
    ap.add_argument("--step-timeout", type=float, default=3.0)
    ap.add_argument("--policy-timeout", type=float, default=8.0)
    ap.add_argument("--retries", type=int, default=0,
                    help="call update() again this many times after TrainingStalled")  # fmt: skip
    args = ap.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    xs, ys = local_data(args.id, 64, 8, 2)
    trainer = start_member(
        args,
        model,
        opt,
        step_timeout_s=args.step_timeout,
        policy_timeout_s=args.policy_timeout,
        stall_timeout_s=args.policy_timeout,  # give up on the step: the test expects it to
    )
    embedded = trainer._embedded  # the test pauses this very daemon
    pid = embedded.proc.pid if embedded is not None else None
    with args.out.open("a") as out:
        write_record(out, {"ready": True, "daemon_pid": pid})
        while True:
            i = trainer.step % 8
            opt.zero_grad()
            x, y = xs[i * 8 : i * 8 + 8], ys[i * 8 : i * 8 + 8]
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            time.sleep(0.02)
            try:
                trainer.update()
            except Exception as exc:  # noqa: BLE001 - the test checks which one
                bases = [c.__name__ for c in type(exc).__mro__]
                write_record(out, {"error": type(exc).__name__, "bases": bases, "msg": str(exc)})
                if type(exc).__name__ == "TrainingStalled" and args.retries > 0:
                    args.retries -= 1
                    continue  # the script decides to try again, as a user's may
                trainer.close()
                return 3
            write_record(out, {"step": trainer.step, "world": trainer.world_size})


if __name__ == "__main__":
    sys.exit(main())
