"""The pure parts of local-steps mode: the boundary decision, the pseudo-gradient, the global
parameters, the config, and the outer step they make (no processes)."""

from __future__ import annotations

import pytest
import torch

from chaos.errors import ConfigError
from chaos.trainer.config import check_num_samples
from chaos.trainer.local_steps import (
    DILOCO_OUTER_LR,
    DILOCO_OUTER_MOMENTUM,
    GlobalParams,
    LocalStepsConfig,
    load_global,
    outer_boundary,
    pseudo_gradient,
)


@pytest.mark.parametrize(
    ("done", "elapsed", "steps", "time_s", "want"),
    [
        (0, 99.0, 5, 1.0, False),  # a phase holds at least one inner step
        (4, 0.5, 5, 1.0, False),
        (5, 0.5, 5, 1.0, True),  # the step bound first
        (2, 1.0, 5, 1.0, True),  # the time bound first
        (2, 0.99, 5, 1.0, False),
        (10_000, 0.1, None, 1.0, False),  # no step bound
        (1, 1e9, 3, None, False),  # no time bound
        (3, 0.0, 3, None, True),
    ],
)
def test_the_phase_ends_at_whichever_bound_comes_first(
    done: int, elapsed: float, steps: int | None, time_s: float | None, want: bool
) -> None:
    assert outer_boundary(done, elapsed, steps, time_s) is want


@pytest.mark.parametrize(
    ("done", "samples", "budget", "want"),
    [
        (3, 23, 24, False),
        (3, 24, 24, True),  # the member's share of the global batch used up
        (1, 8, 1, True),
        (0, 0, 0, False),  # still at least one inner step
        (3, 10_000, None, False),  # no global batch: no sample bound
    ],
)
def test_the_phase_also_ends_at_the_members_share_of_the_global_batch(
    done: int, samples: int, budget: int | None, want: bool
) -> None:
    assert outer_boundary(done, 0.0, 100, 60.0, samples, budget) is want


def test_the_pseudo_gradient_is_global_minus_local_and_sgd_lr_1_lands_on_local() -> None:
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 3)
    glob = GlobalParams(list(model.parameters()))
    start = [p.detach().clone() for p in glob.params]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))  # the inner phase moved the model
    pseudo_gradient(glob.trainable(), list(model.parameters()))
    for g, p, s in zip(glob.params, model.parameters(), start, strict=True):
        assert g.grad is not None
        assert torch.equal(g.grad, s - p.detach())
        assert torch.equal(g.detach(), s), "the global parameters do not move before the step"
    torch.optim.SGD(glob.trainable(), lr=1.0).step()
    for g, p in zip(glob.params, model.parameters(), strict=True):
        torch.testing.assert_close(g.detach(), p.detach())
    pseudo_gradient(glob.trainable(), list(model.parameters()))  # a second boundary reuses .grad
    assert all(g.grad is not None and float(g.grad.abs().max()) < 1e-6 for g in glob.params)


def test_the_weighted_mean_of_pseudo_gradients_steps_to_the_weighted_mean_of_locals() -> None:
    """What the Trainer's allreduce computes from the members' pseudo-gradients,
    ``sum(n_i d_i) / sum(n_i)``, is with SGD at lr 1 the sample-weighted mean of the members'
    local parameters."""
    torch.manual_seed(2)
    base = torch.randn(5)
    locals_ = [base + torch.randn(5) for _ in range(3)]
    samples = [3, 8, 21]
    deltas = [base - p for p in locals_]
    avg = sum(n * d for n, d in zip(samples, deltas, strict=True)) / sum(samples)
    assert isinstance(avg, torch.Tensor)
    want = sum(n * p for n, p in zip(samples, locals_, strict=True)) / sum(samples)
    torch.testing.assert_close(base - avg, want)


def test_global_params_copy_the_parameters_and_leave_buffers_local() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    model[0].bias.requires_grad_(False)  # a frozen parameter travels but is not stepped
    glob = GlobalParams(list(model.parameters()))
    assert [n for n, _ in glob.named_buffers()] == []
    assert len(list(glob.parameters())) == len(list(model.parameters()))
    assert len(glob.trainable()) == len(list(model.parameters())) - 1
    for g, p in zip(glob.params, model.parameters(), strict=True):
        assert torch.equal(g, p) and g.data_ptr() != p.data_ptr()
    with torch.no_grad():
        glob.params[0].add_(1.0)
    load_global(list(model.parameters()), list(glob.params))
    assert torch.equal(model[0].weight, glob.params[0])


def test_the_default_outer_optimizer_is_dilocos_nesterov_sgd() -> None:
    glob = GlobalParams(list(torch.nn.Linear(2, 2).parameters()))
    opt = LocalStepsConfig().outer_optimizer(glob.trainable())
    assert isinstance(opt, torch.optim.SGD)
    group = opt.param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == (
        DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM, True)  # fmt: skip
    assert (DILOCO_OUTER_LR, DILOCO_OUTER_MOMENTUM) == (0.7, 0.9)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"inner_steps": None, "inner_time_s": None},
        {"inner_steps": 0},
        {"inner_steps": True},
        {"inner_steps": 2.5},
        {"inner_time_s": 0.0},
        {"inner_time_s": float("inf")},
        {"outer_lr": 0.0},
        {"outer_momentum": 1.0},
        {"outer_momentum": 0.0},  # Nesterov without momentum
    ],
)
def test_bad_configs_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        LocalStepsConfig(**kwargs)  # type: ignore[arg-type]


def test_a_zero_sample_count_is_accepted_and_a_negative_one_refused() -> None:
    check_num_samples(0)  # a joiner in local mode takes part contributing nothing
    with pytest.raises(ValueError, match="at least 0"):
        check_num_samples(-1)
    LocalStepsConfig(inner_steps=None, inner_time_s=2.0, outer_momentum=0.0,
                     outer_nesterov=False)  # fmt: skip
