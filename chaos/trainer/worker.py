"""What every training-worker script shares: its command line, its Trainer, its records.

A worker is one training process that a launcher (:mod:`chaos.launch`) starts: the benchmark's
(:mod:`chaos.bench.primitives_worker`), the emulator's (:mod:`chaos.emulate.device`) and the
integration tests'. Each one parses the same member arguments (:func:`add_member_arguments`),
builds its :class:`Trainer` from them (:func:`start_member`), trains on local data seeded by its
id (:func:`local_data`) and appends JSON lines to its ``--out`` file (:func:`write_record`,
:class:`EventTail`): each step's record (:func:`step_record`), with a digest of the training
state (:func:`model_digest`) so that a launcher can check the members are bitwise equal, and
the graceful leave's (:func:`leave_cluster`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any, TextIO

import torch

from chaos.trainer import Trainer


def add_member_arguments(parser: argparse.ArgumentParser, listen_help: str | None = None) -> None:
    """Adds ``--id``, ``--listen``, ``--join``, ``--out`` and ``--daemon-arg`` to ``parser``.

    Args:
        parser: The worker's parser.
        listen_help: Help for ``--listen`` (the embedded daemon's ``tcp://HOST:PORT``).
    """
    parser.add_argument("--id", required=True)
    parser.add_argument("--listen", required=True, help=listen_help)
    parser.add_argument("--join", default=None)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument(
        "--daemon-arg", action="append", default=[], help="chaos-daemon start arg (repeat)"
    )


def start_member(
    args: argparse.Namespace,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    **options: Any,
) -> Trainer:
    """The worker's :class:`Trainer`, with its embedded daemon, from its parsed arguments.

    Args:
        args: Parsed by a parser given :func:`add_member_arguments`.
        model: The model it trains.
        optimizer: The model's optimizer.
        **options: More :class:`Trainer` keywords (timeouts, ``host``, ``daemon_dir``, ...).

    Returns:
        The trainer, a member of the cluster (joined through ``--join``, or its founder).

    Raises:
        ConfigError: bad options, endpoints or id.
        ChaosError: the embedded daemon could not start or join, or the state pull failed.
    """
    return Trainer(
        model,
        optimizer,
        join=args.join,
        node_id=args.id,
        listen=args.listen,
        daemon_args=tuple(args.daemon_arg),
        **options,
    )


def wait_for_world(trainer: Trainer, size: int, timeout_s: float) -> None:
    """Blocks until the cluster has at least ``size`` members (a restarted cluster regrouping).

    Args:
        trainer: The member's trainer.
        size: Members to await (at least 1).
        timeout_s: The deadline.

    Raises:
        ChaosTimeout: fewer members after ``timeout_s``.
    """
    trainer.wait_world(max(1, size), timeout_s)


def local_data(
    node_id: str, rows: int, features: int, classes: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """This device's own random training data: a different set on every node.

    Args:
        node_id: The node id (seeds the data).
        rows: Number of samples.
        features: Inputs per sample.
        classes: Number of labels.
        seed: Added to the id's seed.

    Returns:
        ``(inputs, labels)``: ``rows x features`` normal inputs and labels in ``[0, classes)``.
    """
    gen = torch.Generator().manual_seed(sum(map(ord, node_id)) + seed)
    xs = torch.randn(rows, features, generator=gen)
    return xs, torch.randint(0, classes, (rows,), generator=gen)


def model_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> str:
    """SHA-256 over the parameters, buffers, optimizer state tensors and the step.

    Members whose digests at one step are equal hold bitwise equal training states.

    Args:
        model: The member's model.
        optimizer: Its optimizer (the tensors of its state are hashed, in parameter order).
        step: The step the state belongs to.

    Returns:
        The hex digest.
    """
    h = hashlib.sha256(str(step).encode())
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, v in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(v, torch.Tensor):
                    h.update(key.encode())
                    h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def step_record(
    trainer: Trainer, model: torch.nn.Module, optimizer: torch.optim.Optimizer, **fields: Any
) -> dict[str, Any]:
    """The record of the step just taken: its step, epoch, world size, ``fields`` and digest.

    Args:
        trainer: The member's trainer, after its ``update()``.
        model: The model it trains.
        optimizer: The model's optimizer.
        **fields: More values of the step (its loss, its batch size, ...).

    Returns:
        ``{"step", "epoch", "world", **fields, "digest"}``, the digest by :func:`model_digest`.
    """
    return {
        "step": trainer.step,
        "epoch": trainer.epoch,
        "world": trainer.world_size,
        **fields,
        "digest": model_digest(model, optimizer, trainer.step),
    }


def leave_cluster(trainer: Trainer, out: TextIO) -> None:
    """Leaves the cluster gracefully, then records ``{"left": true, "step": N}`` in ``out``.

    Args:
        trainer: The member's trainer.
        out: The open ``--out`` file.
    """
    trainer.request_node_exit()
    write_record(out, {"left": True, "step": trainer.step})


def write_record(out: TextIO, record: dict[str, Any]) -> None:
    """Appends one JSON line to ``out`` and flushes it (a launcher reads it while it runs).

    Args:
        out: The open ``--out`` file.
        record: The record; values JSON cannot hold are written as strings.
    """
    out.write(json.dumps(record, default=str) + "\n")
    out.flush()


class EventTail:
    """The trainer's events raised since the last look (a rerun round, a new membership, ...).

    Args:
        trainer: The member's trainer.
    """

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer
        self._seen = len(trainer.events)

    def new(self) -> list[dict[str, Any]]:
        """The events raised since the previous call (or since construction)."""
        events = list(self._trainer.events[self._seen :])
        self._seen += len(events)
        return events


__all__ = [
    "EventTail",
    "add_member_arguments",
    "leave_cluster",
    "local_data",
    "model_digest",
    "start_member",
    "step_record",
    "wait_for_world",
    "write_record",
]
