"""Elastic data-parallel training of a small CNN on scikit-learn's bundled digits (8x8 images).

One command starts a whole cluster on this machine::

    python examples/digits_classifier.py --nodes 3

The launcher starts 3 worker processes, each with its own embedded ``chaos-daemon``: ``n1``
starts the cluster, ``n2`` joins, ``n3`` joins in the middle of training (it pulls the current
model and optimizer state from the members), ``n2`` leaves gracefully, and finally everyone
leaves. Each worker prints its loss and test accuracy every few steps, and the membership
events as they happen.

Each worker trains on its own shard of the training images (a device's local data: a joiner
brings its shard in, a leaver takes its shard away) and evaluates on the shared test split.
Nothing is downloaded: ``sklearn.datasets.load_digits`` ships with scikit-learn.

A worker can also be started by hand, e.g. on two machines::

    python examples/digits_classifier.py --worker --id a --listen tcp://0.0.0.0:7000
    python examples/digits_classifier.py --worker --id b --listen tcp://0.0.0.0:7000 \\
        --join tcp://HOST_OF_A:7000 --shard 1 --shards 2

and leaves gracefully on Ctrl+C.
"""

from __future__ import annotations

import argparse
import sys

import torch
from elastic import EventPrinter, example_parser, launch, parse_arguments, progress
from torch import nn

from chaos.trainer import Trainer, capture_exit_event


def load_data(shard: int, shards: int) -> tuple[torch.Tensor, ...]:
    """This worker's training shard and the shared test split of the digits.

    Returns:
        ``(x_train, y_train, x_test, y_test)``; images are ``(n, 1, 8, 8)`` floats in [0, 1].

    Raises:
        ValueError: ``shard`` is not in ``[0, shards)``.
    """
    if not 0 <= shard < shards:
        raise ValueError(f"shard must be in [0, {shards}), got {shard}")
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    n_test = len(y) // 5
    x_test, y_test, x_train, y_train = x[:n_test], y[:n_test], x[n_test:], y[n_test:]
    mine = torch.arange(shard, len(y_train), shards)
    return x_train[mine], y_train[mine], x_test, y_test


def make_model() -> nn.Module:
    """A small CNN for 8x8 digits (about 40k parameters)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def worker(args: argparse.Namespace) -> int:
    """One cluster member: trains on its shard until Ctrl+C / SIGTERM or ``--max-steps``."""
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial model everywhere; a joiner's is replaced anyway
    x_train, y_train, x_test, y_test = load_data(args.shard, args.shards)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    trainer = Trainer(model, optimizer, join=args.join, node_id=args.id, listen=args.listen)
    events = EventPrinter(trainer)
    batches = torch.Generator().manual_seed(1 + args.shard)
    while trainer.step < args.max_steps:
        idx = torch.randint(0, len(y_train), (args.batch,), generator=batches)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
        loss.backward()
        trainer.update()  # averages the gradients over the members, then steps Adam
        trainer.check_state_replication()  # serves a joiner if the scheduler asked this node
        events.flush()
        if trainer.step % args.log_every == 0:
            with torch.no_grad():
                acc = (model(x_test).argmax(1) == y_test).float().mean().item()
            progress(trainer, loss=loss.item(), test_acc=acc)
        if capture_exit_event():  # Ctrl+C or SIGTERM: leave gracefully
            break
    trainer.request_node_exit()
    events.flush()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parses the command line; runs the launcher, or one worker with ``--worker``."""
    ap = example_parser(__doc__, phase_steps=60, data="the training images")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--max-steps", type=int, default=100_000, help="worker: stop after")
    args = parse_arguments(ap, argv)
    if args.worker:
        return worker(args)
    return launch(__file__, args, ("batch", "lr", "log_every"))


if __name__ == "__main__":
    sys.exit(main())
