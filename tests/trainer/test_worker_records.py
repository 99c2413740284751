"""The records a worker script writes (``chaos.trainer.worker``): the state digest that tells
bitwise equal members apart from diverged ones, the step record and the leave record."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace
from typing import Any

import torch

from chaos.trainer.worker import leave_cluster, model_digest, step_record


def _trained(seed: int = 0, steps: int = 2) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(7)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(3, 4, generator=data)).square().mean().backward()
        opt.step()
    return model, opt


def test_equal_states_have_one_digest() -> None:
    assert model_digest(*_trained(), step=2) == model_digest(*_trained(), step=2)


def test_the_digest_covers_parameters_optimizer_state_and_step() -> None:
    model, opt = _trained()
    base = model_digest(model, opt, 2)
    assert model_digest(model, opt, 3) != base
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1e-6
    assert model_digest(model, opt, 2) != base
    model, opt = _trained()
    opt.state[next(model.parameters())]["exp_avg"].view(-1)[0] += 1e-6
    assert model_digest(model, opt, 2) != base


def test_the_step_record_holds_the_step_its_fields_and_the_digest() -> None:
    model, opt = _trained()
    trainer: Any = SimpleNamespace(step=2, epoch=5, world_size=3)
    rec = step_record(trainer, model, opt, loss=0.5)
    assert rec == {
        "step": 2,
        "epoch": 5,
        "world": 3,
        "loss": 0.5,
        "digest": model_digest(model, opt, 2),
    }


class _Leaving:
    """A trainer as far as leaving goes: it counts its leave requests."""

    step = 9

    def __init__(self) -> None:
        self.exits = 0

    def request_node_exit(self) -> None:
        self.exits += 1


def test_leaving_asks_the_trainer_to_exit_then_records_it() -> None:
    trainer: Any = _Leaving()
    out = io.StringIO()
    leave_cluster(trainer, out)
    assert trainer.exits == 1
    assert [json.loads(line) for line in out.getvalue().splitlines()] == [{"left": True, "step": 9}]
