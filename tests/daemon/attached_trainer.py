"""A training script attached to a standalone ``chaos-daemon`` (``Trainer(..., daemon=...)``).

Run as ``python attached_trainer.py --id n1 --daemon ipc://... --out F [--joining]``. It trains
a small MLP and appends one JSON line per step to ``--out`` (step, epoch, world size), until it
is killed. ``--joining`` makes it pull the state from the training members instead of starting
with its own.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from chaos.trainer import Trainer


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--id", required=True)
    ap.add_argument("--daemon", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--joining", default=None, help="a member's tcp endpoint: pull the state")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = Trainer(
        model, opt, daemon=args.daemon, join=args.joining, node_id=args.id,
        step_timeout_s=2.0, policy_timeout_s=20.0, join_timeout_s=60.0,
    )  # fmt: skip
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    with args.out.open("a") as out:
        while True:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            trainer.update()
            rec = {"step": trainer.step, "epoch": trainer.epoch, "world": trainer.world_size}
            out.write(json.dumps(rec) + "\n")
            out.flush()


if __name__ == "__main__":
    sys.exit(main())
