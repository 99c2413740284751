"""One emulated device in local-steps mode (``--inner-steps H``): the stand-in model trained with
:class:`chaos.trainer.LocalSteps`, so that a scenario or a campaign runs the DiLoCo-style mode
under the same faults as the default one.

What is replicated and must stay bitwise equal is the global state: the head's global
parameters, the outer optimizer's momentum, and the stand-in's store (the bulk of the state a
joiner pulls), held as ``extra_state`` and advanced only at outer steps (a full fine-tune's
drift runs in ``after_outer_step``). The head's local parameters and its inner optimizer are
each device's own.

Records, as the default mode's (so the harness's figures read them the same way), with
``step`` counting *outer* steps: one ``step`` record per outer step with the digest of the
global state right after that outer optimizer step (taken in ``after_outer_step``, on the
background thread with ``--overlap``), ``stalled``, ``left``. The inner steps of the phase
(``inner_steps``), its samples and its wait in the outer sync (``update_s``) ride along.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, TextIO

import torch

from chaos.emulate.stand_in import StandInModel, state_digest
from chaos.errors import ConfigError
from chaos.trainer import LocalSteps, TrainingStalled
from chaos.trainer.worker import EventTail, write_record

BATCH = 8
"""Samples of one inner step."""


class StoreState:
    """The stand-in's store as ``extra_state``: replicated to joiners, equal on every member,
    changed only by the drift of an outer step.

    Args:
        model: The stand-in model whose store it holds.
    """

    def __init__(self, model: StandInModel) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        """The store tensor."""
        return {"store": self.model.store}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copies a pulled store in."""
        with torch.no_grad():
            self.model.store.copy_(state["store"])


def check_local_args(args: argparse.Namespace) -> None:
    """Local mode takes no stop-resume checkpoint and no held state (the default mode's).

    Raises:
        ConfigError: one of them was given.
    """
    for flag in ("resume", "resume_from", "load_held"):
        if getattr(args, flag) is not None:
            raise ConfigError(f"--{flag.replace('_', '-')} is not supported with --inner-steps")


def start_local(args: argparse.Namespace, model: StandInModel, opt: torch.optim.Optimizer,
                digests: list[tuple[int, str, int]]) -> LocalSteps:  # fmt: skip
    """The device's :class:`LocalSteps`, joined through ``--join`` (or founding the cluster).

    Args:
        args: The device's arguments.
        model: The stand-in model.
        opt: Its inner optimizer.
        digests: Receives ``(outer step, digest of the global state, world size)`` after each
            outer optimizer step.
    """
    holder: list[LocalSteps] = []

    def after_outer() -> None:
        model.drift()  # a full fine-tune's store moves with every outer step
        if holder:  # a joiner's entry inside the constructor has nothing to record
            lo = holder[0]
            digests.append((lo.trainer.step + 1, state_digest(model, lo.outer_optimizer),
                            lo.world_size))  # fmt: skip

    local = LocalSteps(model, opt, join=args.join, node_id=args.id, listen=args.listen,
                       daemon_args=tuple(args.daemon_arg),
                       extra_state={"store": StoreState(model)},
                       inner_steps=args.inner_steps, overlap=args.overlap,
                       after_outer_step=after_outer, host=args.host,
                       daemon_dir=args.daemon_dir, cluster_key=args.cluster_key,
                       step_timeout_s=args.step_timeout, policy_timeout_s=30.0,
                       join_timeout_s=300.0, join_mode=args.join_mode)  # fmt: skip
    holder.append(local)
    return local


def train_local(
    args: argparse.Namespace,
    local: LocalSteps,
    model: StandInModel,
    data: tuple[torch.Tensor, torch.Tensor],
    digests: list[tuple[int, str, int]],
    out: TextIO,
    leave_flag: Path,
    exit_event: Any,
) -> int:
    """The device's loop until it is asked to leave (or is killed)."""
    xs, ys = data
    events = EventTail(local.trainer)
    while not (leave_flag.exists() or exit_event()):
        i = local.inner_steps_total % 64
        local.optimizer.zero_grad()
        model.loss(xs[i * BATCH : i * BATCH + BATCH], ys[i * BATCH : i * BATCH + BATCH]).backward()
        time.sleep(args.step_time)  # stands in for the forward/backward pass of a real model
        try:
            if not local.update(num_samples=BATCH):
                continue
        except TrainingStalled as exc:  # paused or cut off: the next boundary tries again
            write_record(out, {"kind": "stalled", "t": time.time(), "step": local.step,
                               "error": str(exc)[-300:]})  # fmt: skip
            continue
        serving = local.check_state_replication()
        phase = local.last_phase
        while digests:
            step, digest, world = digests.pop(0)
            write_record(out, {"kind": "step", "t": time.time(), "step": step,
                               "epoch": local.epoch, "world": world, "digest": digest,
                               "dur_s": phase["inner_s"] + phase["sync_s"],
                               "update_s": phase.get("wait_s", phase["sync_s"]),
                               "inner_steps": phase["inner_steps"], "serving": serving,
                               "links": local.trainer.data_links,
                               "audit": local.trainer.audit})  # fmt: skip
        for ev in events.new():
            write_record(out, {"kind": "trainer_event", **ev})
    local.request_node_exit()
    write_record(out, {"kind": "left", "t": time.time(), "step": local.step})
    return 0
