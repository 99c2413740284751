"""A training process whose model lives on a device: one member of a test cluster.

Run as ``python device_worker.py --device cuda|staged --id a --listen tcp://... [--join ...]
--out F``. ``cuda`` puts the model and optimizer on the GPU; ``staged`` keeps them on the CPU
but sends every tensor through the host buffers an accelerator uses (the copies the CUDA path
makes, on a machine without a GPU). It trains a small MLP with Adam on its own data and appends
one JSON line per step with a digest of its state; the founder waits at ``--wait-at`` for a
second member.
"""

from __future__ import annotations

import argparse
import sys

import torch

from chaos.replication import staging
from chaos.trainer import gradients
from chaos.trainer.worker import (
    add_member_arguments,
    local_data,
    start_member,
    step_record,
    write_record,
)


def main() -> int:
    ap = argparse.ArgumentParser()
    add_member_arguments(ap)
    ap.add_argument("--device", choices=["cuda", "staged"], required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--wait-at", type=int, default=None)
    args = ap.parse_args()
    if args.device == "staged":
        staging.needs_staging = lambda t: True  # type: ignore[assignment]
        gradients.needs_staging = lambda t: True  # type: ignore[assignment]
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    ).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    xs, ys = local_data(args.id, 64, 16, 4)
    xs, ys = xs.to(device), ys.to(device)
    trainer = start_member(args, model, opt, step_timeout_s=30.0)
    with args.out.open("a") as out:
        while trainer.step < args.steps:
            if trainer.step == args.wait_at:
                trainer.wait_world(2, 120.0)
            i = trainer.step % 8
            opt.zero_grad()
            x, y = xs[i * 8 : i * 8 + 8], ys[i * 8 : i * 8 + 8]
            torch.nn.functional.cross_entropy(model(x), y).backward()
            trainer.update(num_samples=8)
            write_record(out, step_record(trainer, model, opt, device=str(device)))
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
