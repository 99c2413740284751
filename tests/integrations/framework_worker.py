"""What the framework workers (``hf_worker.py``, ``lightning_worker.py``) share: their command
line and their records (one JSON line per optimizer step, one per epoch start, one at the end)."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from chaos import ElasticOptimizer
from chaos.trainer.worker import add_member_arguments, model_digest


def parse_args() -> argparse.Namespace:
    """The member's arguments, ``--max-steps`` and ``--step-time`` (seconds per step)."""
    ap = argparse.ArgumentParser()
    add_member_arguments(ap)
    ap.add_argument("--max-steps", type=int, default=400)
    ap.add_argument("--step-time", type=float, default=0.03)
    return ap.parse_args()


def step_record(opt: ElasticOptimizer, model: torch.nn.Module, global_step: int,
                epoch: float) -> dict[str, Any]:  # fmt: skip
    """An optimizer step's record: the cluster's step, the framework's ``global_step`` and
    epoch, the world size, the learning rate, the clipped norm and the state's digest."""
    step = opt.cluster_step
    return {
        "step": step, "global_step": global_step, "epoch": epoch,
        "world": opt.trainer.world_size, "live": opt.last_step_live,
        "lr": opt.scheduler.get_last_lr()[0] if opt.scheduler else None,
        "grad_norm": opt.last_grad_norm, "digest": model_digest(model, opt.optimizer, step),
    }  # fmt: skip


def epoch_record(opt: ElasticOptimizer, epoch: float) -> dict[str, Any]:
    """An epoch start's record: the cluster's step when the loader began it."""
    return {"epoch_begin": True, "step": opt.cluster_step, "epoch": epoch}


def done_record(opt: ElasticOptimizer, model: torch.nn.Module, global_step: int) -> dict[str, Any]:
    """The end's record: the cluster's step, ``global_step`` and the final digest."""
    step = opt.cluster_step
    return {"done": True, "step": step, "global_step": global_step,
            "digest": model_digest(model, opt.optimizer, step)}  # fmt: skip
