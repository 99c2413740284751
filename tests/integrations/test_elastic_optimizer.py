"""The ElasticOptimizer as a torch optimizer: one real founder (its embedded daemon) in this
process, stepped next to a plain optimizer on a copy of the model; and the misuse it refuses
before anything starts."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Iterator

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau

import chaos
from chaos.errors import ChaosError, ConfigError
from chaos.trainer.elastic_optimizer import SCHEDULER_KEY, ElasticOptimizer, OwnedScheduler


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _warmup(step: int) -> float:
    return min(1.0, (step + 1) / 4)


def _backward(model: torch.nn.Module, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(5, 6, generator=gen), torch.randint(0, 3, (5,), generator=gen)
    loss = torch.nn.functional.cross_entropy(model(x), y) * 50  # large: clipping acts
    loss.backward()
    return loss


@pytest.fixture
def founder() -> Iterator[tuple[torch.nn.Module, ElasticOptimizer]]:
    model = _model()
    opt = ElasticOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model,
                           node_id="elastic-opt", scheduler=lambda o: LambdaLR(o, _warmup),
                           clip_grad_norm=0.5)  # fmt: skip
    try:
        yield model, opt
    finally:
        opt.close()


def test_step_is_clip_then_step_then_schedule_as_a_plain_loop(
    founder: tuple[torch.nn.Module, ElasticOptimizer],
) -> None:
    """Alone, the average is this member's gradient: the wrapper's steps equal a plain loop's
    (clip, SGD with momentum, the schedule) bit for bit; the framework's own scheduler.step()
    calls change nothing; param_groups and state are the wrapped optimizer's."""
    model, opt = founder
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_sched = LambdaLR(ref_opt, _warmup)
    assert opt.param_groups is opt.optimizer.param_groups
    assert opt.state is opt.optimizer.state
    assert isinstance(opt.scheduler, OwnedScheduler)
    for i in range(6):
        opt.zero_grad()
        loss = opt.step(closure=lambda i=i: _backward(model, i))
        assert loss is not None and opt.last_step_live
        assert opt.scheduler.step() is None  # HF / Lightning / a habit: a no-op
        ref_opt.zero_grad()
        _backward(ref, i)
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_sched.step()
        assert opt.last_grad_norm == float(norm) and float(norm) > 0.5
        assert opt.cluster_step == i + 1 == opt.scheduler.last_epoch == ref_sched.last_epoch
        assert opt.scheduler.get_last_lr() == ref_sched.get_last_lr()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q), f"step {i}: parameters differ from the plain loop"
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.1
    # the scheduler travels: it is the Trainer's extra state, in its checkpoint too
    assert opt.trainer.extra_state[SCHEDULER_KEY] is opt.scheduler.inner
    assert opt.trainer.state_dict()["extra"][SCHEDULER_KEY]["last_epoch"] == 6


def test_state_dict_round_trips_and_lr_edits_reach_the_wrapped_optimizer(
    founder: tuple[torch.nn.Module, ElasticOptimizer],
) -> None:
    model, opt = founder
    for i in range(3):
        opt.zero_grad()
        _backward(model, i)
        opt.step()
    state = opt.state_dict()
    assert state == opt.optimizer.state_dict()
    assert len(state["state"]) == len(list(model.parameters()))  # momentum buffers
    other = torch.optim.SGD(_model().parameters(), lr=0.1, momentum=0.9)
    other.load_state_dict(state)  # the wrapped optimizer's own format
    for k, v in other.state_dict()["state"].items():
        assert torch.equal(v["momentum_buffer"], state["state"][k]["momentum_buffer"])
    opt.param_groups[0]["lr"] = 0.01
    assert opt.optimizer.param_groups[0]["lr"] == 0.01
    saved = copy.deepcopy(state)
    opt.load_state_dict(saved)
    assert opt.optimizer.param_groups[0]["lr"] == state["param_groups"][0]["lr"]


def test_misuse_after_construction_is_refused(
    founder: tuple[torch.nn.Module, ElasticOptimizer],
) -> None:
    model, opt = founder
    with pytest.raises(ChaosError, match="parameter groups cannot be added"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    with pytest.raises(ChaosError, match="pickle"):
        pickle.dumps(opt)
    with pytest.raises(ConfigError, match="already an ElasticOptimizer"):
        ElasticOptimizer(opt, model)
    opt.close()
    with pytest.raises(ChaosError, match="closed"):
        opt.step()


def test_misuse_before_anything_starts_is_refused() -> None:
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    assert chaos.ElasticOptimizer is ElasticOptimizer  # the top-level name
    with pytest.raises(ConfigError, match="wraps a torch.optim.Optimizer"):
        ElasticOptimizer(object(), model)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="not the model's"):
        ElasticOptimizer(torch.optim.SGD(_model().parameters(), lr=0.1), model)
    with pytest.raises(ConfigError, match="clip_grad_norm"):
        ElasticOptimizer(sgd, model, clip_grad_norm=-1.0)
    with pytest.raises(ConfigError, match="ReduceLROnPlateau"):
        ElasticOptimizer(sgd, model, scheduler=lambda o: ReduceLROnPlateau(o))
    with pytest.raises(ConfigError, match="built on the optimizer it is given"):
        ElasticOptimizer(sgd, model, scheduler=lambda o: LambdaLR(sgd, _warmup))
    with pytest.raises(ConfigError, match="scheduler's key"):
        ElasticOptimizer(sgd, model, scheduler=lambda o: LambdaLR(o, _warmup),
                         extra_state={SCHEDULER_KEY: object()})  # fmt: skip
    with pytest.raises(ConfigError, match="unknown Trainer option"):
        ElasticOptimizer(sgd, model, no_such_option=1)
