"""A training process in local-steps mode (:class:`chaos.trainer.LocalSteps`): one real member.

Each inner step trains a small MLP on this device's own data with its own Adam; every outer
boundary appends one JSON line to ``--out``: the outer step reached, epoch, world size, the
inner steps and samples of the phase, the seconds spent in the outer sync, and a SHA-256 over
the global parameters and the outer optimizer's state (the state every member must hold bitwise
equal). ``<out>.leave`` asks it to leave gracefully at its next boundary.

- ``--inner-steps H`` / ``--inner-time T``: the phase's bounds; ``--inner-sleep S`` sleeps
  ``S`` seconds per inner step (a slower device).
- ``--plain-outer``: the outer optimizer is SGD with lr 1 and no momentum, so that the new
  global parameters are the sample-weighted mean of the members' local parameters;
  ``--dump-dir D`` then saves, for each outer step, the local parameters before the sync, the
  phase's samples and the global parameters before and after it.
- ``--die-after K``: ``kill -9`` in the outer allreduce, ``K`` outer steps after joining.
- ``--global-batch G``: the samples of one outer step over the cluster, split by speed: a
  phase also ends at this member's share (recorded as ``budget``).
- ``--overlap``: the outer step runs in the background while the next inner phase computes;
  the digests are then taken on that thread right after each outer optimizer step (one record
  each), and each boundary also appends a record without a digest (``boundary``: its phase's
  ``wait_s`` and ``overlapped`` inner steps).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

from chaos.trainer import LocalSteps
from chaos.trainer.worker import add_member_arguments, local_data, model_digest, write_record


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_member_arguments(ap)
    ap.add_argument("--max-outer", type=int, default=10_000)
    ap.add_argument("--inner-steps", type=int, default=None)
    ap.add_argument("--inner-time", type=float, default=None)
    ap.add_argument("--inner-sleep", type=float, default=0.01)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--plain-outer", action="store_true")
    ap.add_argument("--dump-dir", type=Path, default=None)
    ap.add_argument("--die-after", type=int, default=None)
    ap.add_argument("--global-batch", type=int, default=None)
    ap.add_argument("--overlap", action="store_true")
    return ap.parse_args()


def build_model() -> torch.nn.Module:
    """The small MLP every member trains (the same initial weights everywhere)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def main() -> int:
    args = _parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    model = build_model()
    inner = torch.optim.Adam(model.parameters(), lr=0.01)
    xs, ys = local_data(args.id, 512, 16, 4)
    outer: Any = None
    if args.plain_outer:
        def outer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
            return torch.optim.SGD(params, lr=1.0)

    # with --overlap the outer step runs on a background thread: the global state is digested
    # there, right after each outer optimizer step, not from the loop while it may change
    hooked: list[tuple[int, str, int]] = []
    holder: list[LocalSteps] = []

    def digest_outer() -> None:
        if not holder:  # the joiner's entry, inside the constructor: nothing to record yet
            return
        lo = holder[0]
        step = lo.trainer.step + 1  # the step this outer step reaches
        hooked.append((step, model_digest(lo.global_params, lo.outer_optimizer, step),
                       lo.world_size))  # fmt: skip

    local = LocalSteps(model, inner, join=args.join, node_id=args.id, listen=args.listen,
                       daemon_args=tuple(args.daemon_arg), inner_steps=args.inner_steps,
                       inner_time_s=args.inner_time, outer_optimizer=outer,
                       step_timeout_s=20.0, global_batch=args.global_batch,
                       overlap=args.overlap,
                       after_outer_step=digest_outer if args.overlap else None)  # fmt: skip
    holder.append(local)
    if args.die_after is not None:
        local.fail_at(local.step + args.die_after)
    leave_flag = args.out.with_suffix(".leave")
    last: list[list[torch.Tensor]] = [[]]

    def inner_step() -> None:  # the local parameters a boundary averages, as they end
        inner.step()
        if args.dump_dir is not None:
            last[0] = [p.detach().clone() for p in model.parameters()]

    with args.out.open("a") as out:
        write_record(out, {"ready": True, "step": local.step, "epoch": local.epoch})
        while local.step < args.max_outer and not leave_flag.exists():
            idx = (torch.arange(args.batch) + local.inner_steps_total * args.batch) % xs.shape[0]
            inner.zero_grad()
            torch.nn.functional.cross_entropy(model(xs[idx]), ys[idx]).backward()
            time.sleep(args.inner_sleep)
            g_before = [g.detach().clone() for g in local.global_params.params]
            step = local.step
            if not local.update(num_samples=args.batch, step_fn=inner_step):
                continue
            local.check_state_replication()
            phase = local.last_phase
            if args.dump_dir is not None and phase["live"]:
                args.dump_dir.mkdir(parents=True, exist_ok=True)
                torch.save({"local": last[0], "samples": phase["samples"], "before": g_before,
                            "after": [g.detach().clone() for g in local.global_params.params],
                            "world": local.world_size},
                           args.dump_dir / f"{args.id}-{step}.pt")  # fmt: skip
            rec = {"step": local.step, "epoch": local.epoch, "world": local.world_size,
                   **{k: phase[k] for k in ("inner_steps", "samples", "sync_s", "live")},
                   **{k: phase[k] for k in ("wait_s", "overlapped") if k in phase},
                   "audits": local.trainer.audit["audits"], "budget": local.phase_budget,
                   "mismatches": local.trainer.audit["mismatches"]}  # fmt: skip
            if not args.overlap:
                rec["digest"] = model_digest(local.global_params, local.outer_optimizer,
                                             local.step)  # fmt: skip
                write_record(out, rec)
                continue
            while hooked:  # the outer steps that ended in the background since the last one
                s, digest, size = hooked.pop(0)
                write_record(out, {**rec, "step": s, "world": size, "digest": digest})
            write_record(out, {**rec, "boundary": True})
        local.request_node_exit()
        write_record(out, {"left": True, "step": local.step})
    return 0


if __name__ == "__main__":
    sys.exit(main())
