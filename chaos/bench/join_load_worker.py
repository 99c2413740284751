"""One trainer of ``chaos-bench join-load``: a founder or a joiner with its embedded daemon.

The launcher (:mod:`chaos.bench.join_load`) runs this file by its path
(``python -P .../join_load_worker.py``), not as a module, so that the same script drives
whichever ``chaos`` package the chosen interpreter has installed: an older release as well as
this tree. It therefore uses only what every release's public API offers:
``Trainer(model, optimizer, join=..., node_id=..., listen=...)``, ``trainer.update()``,
``trainer.check_state_replication()``, ``trainer.step``, ``capture_exit_event()`` and
``trainer.request_node_exit()``. The launcher starts it in a directory of its own: its
embedded daemon runs ``python -m``, which puts the working directory first on its path.

It writes one JSON record a line to ``--out``:

- ``imported``: the ``chaos`` package it runs (its file), before the Trainer starts;
- ``ready``: the constructor returned (``elapsed_s`` since this process started, ``step``);
- ``stepped``: the first ``update()`` after which ``trainer.step`` grew (``elapsed_s``,
  ``step``); a founder writes it once, then trains on;
- ``error``: the constructor or a step raised (``error``: the exception's type and text).

It trains until the launcher kills its process group (its embedded daemon is in that group), or
until SIGTERM or Ctrl+C, when it leaves (``request_node_exit``).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import sys
import time
from typing import Any, TextIO

STEP_PAUSE_S = 0.05
"""A founder's pause between steps, so that the joiners' donors are not a tight loop."""


def _write(out: TextIO, started: float, event: str, **fields: Any) -> None:
    """Appends one record and flushes it, so that the launcher sees it at once."""
    record = {"event": event, "elapsed_s": round(time.monotonic() - started, 3), **fields}
    out.write(json.dumps(record) + "\n")
    out.flush()


def _train(out: TextIO, started: float, args: argparse.Namespace) -> None:
    """Builds the Trainer and trains until killed, writing ``ready`` and ``stepped``."""
    import torch
    from torch import nn

    import chaos
    from chaos.trainer import Trainer, capture_exit_event

    _write(out, started, "imported", chaos=str(getattr(chaos, "__file__", "?")))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = Trainer(model, optimizer, join=args.join, node_id=args.node_id, listen=args.listen)
    _write(out, started, "ready", step=int(trainer.step))
    x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
    stepped = False
    while not capture_exit_event():  # SIGTERM or Ctrl+C (the launcher itself kills)
        before = trainer.step
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        trainer.update()
        trainer.check_state_replication()
        if not stepped and trainer.step > before:
            stepped = True
            _write(out, started, "stepped", step=int(trainer.step))
        time.sleep(STEP_PAUSE_S)
    trainer.request_node_exit()


def main(argv: list[str] | None = None) -> int:
    """Runs one trainer; returns 1 after writing an ``error`` record."""
    started = time.monotonic()
    ap = argparse.ArgumentParser(prog="join_load_worker")
    ap.add_argument("--node-id", required=True)
    ap.add_argument("--listen", required=True, help="the embedded daemon's control endpoint")
    ap.add_argument("--join", default=None, help="a member's daemon endpoint; none: found")
    ap.add_argument("--out", required=True, help="the JSON-lines record file")
    args = ap.parse_args(argv)
    # a trainer still pending at the run's deadline: the launcher asks for every thread's stack
    # (written to stderr, the trainer's log) before it kills the run
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    with open(args.out, "a", encoding="utf-8") as out:
        try:
            _train(out, started, args)
        except Exception as exc:  # recorded for the launcher, which counts the run failed
            _write(out, started, "error", error=f"{type(exc).__name__}: {exc}"[:4000])
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
