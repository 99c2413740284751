"""One emulated device's training process: ``python -m chaos.emulate.device ...``.

The harness starts one of these per device, inside the device's network namespace. It is a real
:class:`chaos.trainer.Trainer` with its embedded ``chaos-daemon``; it trains a stand-in model
whose training state has the byte size of a paper model (times the run's ``--scale``), in the
kind the model name picks (:mod:`chaos.emulate.stand_in`):

* a buffer holds the bulk of the state: it is replicated to joiners like any state, but it takes
  no gradient, so the allreduce and the compute stay small enough for 2 cores. A fresh device
  initialises it from its id (a joiner pulls it all); a full fine-tune's drifts every step; a
  LoRA model's is the frozen base every device holds, beside trainable adapters;
* a small trainable MLP head gives real gradients, a real allreduce and a real optimizer step
  every step, so members must stay bitwise equal.

So the harness's figures measure scale-out, replication and the control plane, not training
throughput; that is stated wherever they are reported.

The device appends JSON lines to ``--out``: ``ready`` (with the trainer's join and replication
events), one ``step`` record per step (its duration and the time spent in ``update``),
``stalled`` when ``update`` raised ``TrainingStalled`` (its daemon paused, or it is cut off: it
keeps its gradients and tries again) and ``left``. The harness steers it through files beside
``--out``: ``<out>.leave`` asks for a graceful leave at the next step boundary (when it holds
``keep``, the device first saves its model and optimizer state dicts to ``<out>``'s
``.held.pt`` sibling, which ``--load-held`` loads before a later join: a returning device);
``<out>.checkpoint`` asks it to save its state to that path's ``.pt`` sibling and exit (the
stop-resume baseline).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch

from chaos.emulate.stand_in import HEAD_IN, HEAD_OUT, StandInConfig, StandInModel, state_digest
from chaos.trainer import TrainingStalled, capture_exit_event
from chaos.trainer.worker import (
    EventTail,
    add_member_arguments,
    local_data,
    start_member,
    wait_for_world,
    write_record,
)

GATE_TIMEOUT_S = 600.0


def _wait_gate(path: Path) -> None:
    """Blocks until the harness creates ``path`` (restarts load in parallel, join in order).

    Raises:
        ChaosTimeout: no gate after :data:`GATE_TIMEOUT_S`.
    """
    from chaos.errors import ChaosTimeout

    deadline = time.monotonic() + GATE_TIMEOUT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise ChaosTimeout(f"start gate {path} not opened within {GATE_TIMEOUT_S} s")
        time.sleep(0.02)  # polling a file the harness creates


def _fetch_checkpoint(store: str) -> tuple[dict[str, Any], float]:
    """Reads the stop-resume checkpoint from the store device ``HOST:PORT`` over the network.

    Returns:
        The state dict and the seconds the transfer took.

    Raises:
        StoreTimeout: the store did not deliver in time.
        CheckpointFetchError: a bad or partial checkpoint.
    """
    import io

    from chaos.emulate.ckpt_store import fetch

    host, _, port = store.rpartition(":")
    t0 = time.monotonic()
    data = fetch(host, int(port))
    took = time.monotonic() - t0
    return torch.load(io.BytesIO(data), weights_only=True), took  # no pickle from the wire


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m chaos.emulate.device")
    add_member_arguments(ap, listen_help="the embedded daemon's tcp://IP:PORT")
    ap.add_argument("--host", required=True, help="address the data plane binds")
    ap.add_argument("--model", default="synthetic:8")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--step-time", type=float, default=0.05, help="emulated compute, seconds")
    ap.add_argument("--daemon-dir", default=None)
    ap.add_argument("--cluster-key", default=None,
                    help="the run's cluster key file (daemon and data plane)")  # fmt: skip
    ap.add_argument("--resume", type=Path, default=None, help="stop-resume checkpoint to load")
    ap.add_argument("--resume-from", default=None, metavar="HOST:PORT",
                    help="read the stop-resume checkpoint from this store")  # fmt: skip
    ap.add_argument("--wait-world", type=int, default=0, help="with --resume: members to await")
    ap.add_argument("--gate", type=Path, default=None,
                    help="load everything, then wait for this file before joining")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-timeout", type=float, default=60.0,
                    help="TrainerConfig.step_timeout_s (the scenario's step_timeout_s)")
    ap.add_argument("--join-mode", choices=["catch-up", "barrier"], default="catch-up",
                    help="TrainerConfig.join_mode")  # fmt: skip
    ap.add_argument("--inner-steps", type=int, default=0,
                    help="local-steps mode: an outer step every this many inner steps "
                         "(0: synchronise every step)")  # fmt: skip
    ap.add_argument("--overlap", action="store_true",
                    help="with --inner-steps: the outer step runs beside the next inner phase")
    ap.add_argument(
        "--no-base-on-disk",
        action="store_true",
        help="gpt2-lora: this device has no base checkpoint (a fresh random base)",
    )
    ap.add_argument(
        "--load-held",
        type=Path,
        default=None,
        help="the model and optimizer state it held when it left; joins with it",
    )
    args = ap.parse_args(argv)
    if args.inner_steps < 0:
        ap.error(f"--inner-steps must be >= 0, got {args.inner_steps}")
    if args.overlap and not args.inner_steps:
        ap.error("--overlap needs --inner-steps")
    return args


def split_join(args: argparse.Namespace) -> argparse.Namespace:
    """``--join A,B,...``: the trainer takes the first contact (one endpoint) and its embedded
    daemon every other one as a further ``--join`` (its contacts, tried in turn)."""
    contacts = [c for c in (args.join or "").split(",") if c]
    if len(contacts) < 2:
        return args
    rest = [f"--join={','.join(contacts[1:])}"]
    return argparse.Namespace(**{**vars(args), "join": contacts[0],
                                 "daemon_arg": [*args.daemon_arg, *rest]})  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Runs the device until it is asked to leave or checkpoint, or is killed."""
    args = split_join(_parse(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = StandInModel(StandInConfig(args.model, args.scale, args.id,
                                       base_on_disk=not args.no_base_on_disk))  # fmt: skip
    opt = model.optimizer()
    if args.load_held is not None:  # a returning device: what it held when it left
        held = torch.load(args.load_held, weights_only=True)
        model.load_state_dict(held["model"])
        opt.load_state_dict(held["optimizer"])
    xs, ys = local_data(args.id, 512, HEAD_IN, HEAD_OUT, args.seed)  # this device's own data
    started = time.time()
    if args.inner_steps:
        return _main_local(args, model, opt, (xs, ys), started)
    fetch_s = None
    if args.resume_from is not None:
        state, fetch_s = _fetch_checkpoint(args.resume_from)
    elif args.resume is not None:
        state = torch.load(args.resume, weights_only=True)
    if args.resume is not None or args.resume_from is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    if args.gate is not None:
        _wait_gate(args.gate)
    trainer = start_member(
        args,
        model,
        opt,
        host=args.host,
        daemon_dir=args.daemon_dir,
        cluster_key=args.cluster_key,
        step_timeout_s=args.step_timeout,
        policy_timeout_s=30.0,
        join_timeout_s=300.0,
        restored=args.resume is not None or args.resume_from is not None,
        join_mode=args.join_mode,
    )
    if args.resume is not None or args.resume_from is not None:
        trainer.load_state_dict(state)  # the checkpoint's step and RNG
        wait_for_world(trainer, args.wait_world, 300.0)
    leave_flag = args.out.with_suffix(".leave")
    ckpt_flag = args.out.with_suffix(".checkpoint")
    with args.out.open("a") as out:
        write_record(out, {"kind": "ready", "t": time.time(), "started": started,
                           "step": trainer.step, "epoch": trainer.epoch,
                           "events": list(trainer.events),
                           "held": str(args.load_held) if args.load_held else None,
                           "checkpoint_fetch_s": fetch_s})  # fmt: skip
        return _train(args, trainer, model, opt, xs, ys, out, leave_flag, ckpt_flag,
                      capture_exit_event)  # fmt: skip


def _main_local(args: argparse.Namespace, model: StandInModel, opt: torch.optim.Optimizer,
                data: tuple[torch.Tensor, torch.Tensor], started: float) -> int:  # fmt: skip
    """The device in local-steps mode (:mod:`chaos.emulate.device_local`)."""
    from chaos.emulate.device_local import check_local_args, start_local, train_local

    check_local_args(args)
    if args.gate is not None:
        _wait_gate(args.gate)
    digests: list[tuple[int, str, int]] = []
    local = start_local(args, model, opt, digests)
    with args.out.open("a") as out:
        write_record(out, {"kind": "ready", "t": time.time(), "started": started,
                           "step": local.step, "epoch": local.epoch,
                           "events": list(local.events), "held": None,
                           "checkpoint_fetch_s": None,
                           "inner_steps": args.inner_steps})  # fmt: skip
        return train_local(args, local, model, data, digests, out,
                           args.out.with_suffix(".leave"), capture_exit_event)  # fmt: skip


def _train(
    args: argparse.Namespace,
    trainer: Any,
    model: StandInModel,
    opt: torch.optim.Optimizer,
    xs: torch.Tensor,
    ys: torch.Tensor,
    out: TextIO,
    leave_flag: Path,
    ckpt_flag: Path,
    exit_event: Any,
) -> int:
    events = EventTail(trainer)
    while True:
        t0 = time.time()
        i = trainer.step % 64
        opt.zero_grad()
        x, y = xs[i * 8 : i * 8 + 8], ys[i * 8 : i * 8 + 8]
        loss = model.loss(x, y)
        loss.backward()
        time.sleep(args.step_time)  # stands in for the forward/backward pass of the real model
        t1 = time.time()
        try:
            trainer.update(after_step=model.drift)  # a full fine-tune's store changes too
        except TrainingStalled as exc:  # paused or cut off: wait on (the gradients are intact)
            write_record(out, {"kind": "stalled", "t": time.time(), "step": trainer.step,
                               "error": str(exc)[-300:]})  # fmt: skip
            if leave_flag.exists() or exit_event():
                break
            continue
        serving = trainer.check_state_replication()
        t2 = time.time()
        write_record(out, {"kind": "step", "t": t2, "step": trainer.step, "epoch": trainer.epoch,
                           "world": trainer.world_size, "dur_s": t2 - t0,
                           "update_s": t2 - t1, "serving": serving,
                           "links": trainer.data_links,
                           "loss": float(loss.detach()),
                           "digest": state_digest(model, opt),
                           "audit": trainer.audit})  # fmt: skip
        for ev in events.new():
            write_record(out, {"kind": "trainer_event", **ev})
        if ckpt_flag.exists():
            path = ckpt_flag.with_suffix(".pt")
            save = ckpt_flag.read_text().strip() != "stop"  # only the store device writes
            if save:
                torch.save(trainer.state_dict(), path)
            write_record(out, {"kind": "checkpointed", "t": time.time(), "step": trainer.step,
                               "path": str(path) if save else None})  # fmt: skip
            trainer.close()
            return 0
        if leave_flag.exists() or exit_event():
            held = _keep_state(leave_flag, model, opt)
            trainer.request_node_exit()
            write_record(out, {"kind": "left", "t": time.time(), "step": trainer.step,
                               "held": held})  # fmt: skip
            return 0
    trainer.request_node_exit()  # asked to leave while stalled
    write_record(out, {"kind": "left", "t": time.time(), "step": trainer.step})
    return 0


def _keep_state(leave_flag: Path, model: StandInModel, opt: torch.optim.Optimizer) -> str | None:
    """Saves the model and optimizer state dicts beside the leave flag when it says ``keep``
    (the device will come back with them); returns the file, or ``None``."""
    if not leave_flag.exists() or leave_flag.read_text().strip() != "keep":
        return None
    path = leave_flag.with_suffix(".held.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    return str(path)


if __name__ == "__main__":
    sys.exit(main())
