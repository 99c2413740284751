"""One emulated device's training process: ``python -m chaos.emulate.device ...``.

The harness starts one of these per device, inside the device's network namespace. It is a real
:class:`chaos.trainer.Trainer` with its embedded ``chaos-daemon``; it trains a stand-in model
whose training state has the byte size of a paper model (times the run's ``--scale``):

* a frozen buffer holds the bulk of the state: it is replicated to joiners like any state, but
  it takes no gradient, so the allreduce and the compute stay small enough for 2 cores;
* a small trainable MLP head (SGD with momentum) gives real gradients, a real allreduce and a
  real optimizer step every step, so members must stay bitwise equal.

So the harness's figures measure scale-out, replication and the control plane, not training
throughput; that is stated wherever they are reported.

The device appends JSON lines to ``--out``: ``ready`` (with the trainer's join and replication
events), one ``step`` record per step (its duration and the time spent in ``update``),
``stalled`` when ``update`` raised ``TrainingStalled`` (its daemon paused, or it is cut off: it
keeps its gradients and tries again) and ``left``. The harness steers it through files beside
``--out``: ``<out>.leave`` asks for a graceful leave at the next step boundary;
``<out>.checkpoint`` asks it to save its state to that path's ``.pt`` sibling and exit (the
stop-resume baseline).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch

from chaos.models import model_summary
from chaos.trainer import TrainingStalled, capture_exit_event
from chaos.trainer.worker import (
    EventTail,
    add_member_arguments,
    local_data,
    start_member,
    wait_for_world,
    write_record,
)

HEAD_IN = 32
HEAD_HIDDEN = 64
HEAD_OUT = 8
_MIN_STORE_ELEMS = 1


class StandInModel(torch.nn.Module):
    """A frozen state store of ``store_bytes`` plus a small trainable head.

    Args:
        store_bytes: Size of the frozen buffer (rounded down to whole fp32 elements).
    """

    def __init__(self, store_bytes: int) -> None:
        super().__init__()
        elems = max(_MIN_STORE_ELEMS, store_bytes // 4)
        gen = torch.Generator().manual_seed(1234)
        self.register_buffer("store", torch.rand(elems, generator=gen))
        self.head = torch.nn.Sequential(
            torch.nn.Linear(HEAD_IN, HEAD_HIDDEN),
            torch.nn.ReLU(),
            torch.nn.Linear(HEAD_HIDDEN, HEAD_OUT),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(x)
        return out


def head_state_bytes() -> int:
    """Bytes of the head's parameters plus its SGD momentum buffers."""
    params = HEAD_IN * HEAD_HIDDEN + HEAD_HIDDEN + HEAD_HIDDEN * HEAD_OUT + HEAD_OUT
    return 2 * 4 * params


def store_bytes_for(model: str, scale: float) -> int:
    """Frozen-buffer size that makes the whole state ``scale`` times the model's state size.

    Raises:
        ValueError: unknown model name or a non-positive scale.
    """
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    target = int(model_summary(model)["state_bytes"] * scale)
    return max(4, target - head_state_bytes())


def state_digest(model: StandInModel, opt: torch.optim.Optimizer) -> str:
    """SHA-256 of the head's parameters and momentum buffers (the part that trains)."""
    h = hashlib.sha256()
    for p in model.head.parameters():
        h.update(p.detach().numpy().tobytes())
        buf = opt.state.get(p, {}).get("momentum_buffer")
        if isinstance(buf, torch.Tensor):
            h.update(buf.numpy().tobytes())
    return h.hexdigest()[:32]


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
    return ap.parse_args(argv)


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
    model = StandInModel(store_bytes_for(args.model, args.scale))
    opt = torch.optim.SGD(model.head.parameters(), lr=0.01, momentum=0.9)
    xs, ys = local_data(args.id, 512, HEAD_IN, HEAD_OUT, args.seed)  # this device's own data
    started = time.time()
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
        step_timeout_s=60.0,
        policy_timeout_s=30.0,
        join_timeout_s=300.0,
        restored=args.resume is not None or args.resume_from is not None,
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
                           "checkpoint_fetch_s": fetch_s})  # fmt: skip
        return _train(args, trainer, model, opt, xs, ys, out, leave_flag, ckpt_flag,
                      capture_exit_event)  # fmt: skip


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
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        time.sleep(args.step_time)  # stands in for the forward/backward pass of the real model
        t1 = time.time()
        try:
            trainer.update()
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
                           "loss": float(loss.detach()),
                           "digest": state_digest(model, opt)})  # fmt: skip
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
            trainer.request_node_exit()
            write_record(out, {"kind": "left", "t": time.time(), "step": trainer.step})
            return 0
    trainer.request_node_exit()  # asked to leave while stalled
    write_record(out, {"kind": "left", "t": time.time(), "step": trainer.step})
    return 0


if __name__ == "__main__":
    sys.exit(main())
