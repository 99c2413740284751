"""The throughput a trainer measures for the global batch's split counts a step's compute only.

What a script does before its first ``update()`` (waiting for the others, loading data) is not a
step: the clock starts when the first ``update()`` returns, so the first measurement is the
second step's compute. A single real trainer with its embedded daemon; no timing is asserted.
"""

from __future__ import annotations

import time

import torch

from chaos.trainer import Trainer


def _step(model: torch.nn.Module, trainer: Trainer, n: int) -> None:
    model(torch.randn(n, 4)).sum().backward()
    trainer.update(num_samples=n)


def test_the_first_update_starts_the_clock_and_the_second_measures() -> None:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Trainer(model, opt, node_id="clock", global_batch=8) as trainer:
        time.sleep(0.5)  # the script does something else before its first step
        _step(model, trainer, 8)
        assert trainer.samples_per_s is None  # no step's compute measured yet
        _step(model, trainer, 8)
        assert trainer.samples_per_s is not None and trainer.samples_per_s > 0
