"""Host staging: the state stream and the allreduce buffer for tensors on an accelerator.

No accelerator is needed: the staging path is taken for CPU tensors by treating them as if
they lived on one (``needs_staging`` is the one place that decides), which exercises every copy
the CUDA path makes. tests/cuda/ runs the same on a real GPU when there is one.
"""

from __future__ import annotations

import random

import pytest
import torch

from chaos.replication import staging
from chaos.replication.state import TrainingState, state_diff, state_equal
from chaos.trainer import gradients


@pytest.fixture
def staged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor goes through a host buffer, as on an accelerator."""
    monkeypatch.setattr(staging, "needs_staging", lambda t: True)
    monkeypatch.setattr(gradients, "needs_staging", lambda t: True)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
    )


def _trained(seed: int, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        x, y = torch.randn(6, 5, generator=gen), torch.randint(0, 2, (6,), generator=gen)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


def _copy(src: TrainingState, dst: TrainingState, chunk: int = 97) -> None:
    ranges = [(o, min(chunk, src.total_bytes - o)) for o in range(0, src.total_bytes, chunk)]
    random.Random(3).shuffle(ranges)
    for off, length in ranges:
        dst.write(off, src.read(off, length))


def test_a_cpu_tensor_is_its_own_host_copy() -> None:
    t = torch.arange(6, dtype=torch.float32)
    s = staging.HostStaging([t], ["t"])
    assert s.staged == 0
    assert s.hosts[0].data_ptr() == t.data_ptr()


def test_staged_tensors_copy_both_ways(staged: None) -> None:
    t = torch.arange(6, dtype=torch.float32)
    s = staging.HostStaging([t], ["t"])
    assert s.staged == 1
    host = s.hosts[0]
    assert host.data_ptr() != t.data_ptr()
    s.to_host()
    assert torch.equal(host, t)
    host.fill_(7.0)
    assert not torch.equal(host, t)  # nothing reaches the tensor before to_device
    s.to_device()
    assert torch.equal(t, torch.full((6,), 7.0))


def test_a_staged_tensor_need_not_be_contiguous(staged: None) -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    s = staging.HostStaging([base.t()], ["t"])
    s.to_host()
    assert s.hosts[0].is_contiguous() and torch.equal(s.hosts[0], base.t())


def test_a_non_contiguous_cpu_tensor_and_a_sparse_one_are_refused() -> None:
    with pytest.raises(ValueError, match="not contiguous"):
        staging.HostStaging([torch.zeros(3, 4).t()], ["model/w"])
    with pytest.raises(ValueError, match="dense"):
        staging.HostStaging([torch.zeros(3, 3).to_sparse()], ["model/s"])
    with pytest.raises(TypeError, match="not a tensor"):
        staging.HostStaging([[1.0]], ["model/x"])  # type: ignore[list-item]


def test_a_staged_donor_serves_its_values_when_first_read(staged: None) -> None:
    model, opt = _trained(0, 3)
    donor = TrainingState.capture(model, opt, step=3, epoch=1)
    before = bytes(donor.read(0, donor.total_bytes))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the device tensors move on; the served bytes are the snapshot's
    assert bytes(donor.read(0, donor.total_bytes)) == before


def test_a_staged_joiner_gets_the_state_bitwise_and_only_when_it_is_applied(staged: None) -> None:
    model, opt = _trained(0, 3)
    donor = TrainingState.capture(model, opt, step=3, epoch=1, hyperparameters={"lr": 0.01})
    j_model, _ = _trained(5, 0)
    j_opt = torch.optim.Adam(j_model.parameters(), lr=1e-2)
    weight_before = j_model[0].weight.detach().clone()
    joiner = TrainingState.for_joiner(j_model, j_opt, donor.manifest_bytes)
    _copy(donor, joiner)
    assert torch.equal(j_model[0].weight, weight_before)  # host buffers only, so far
    runtime = joiner.apply()
    assert runtime.step == 3
    assert torch.equal(j_model[0].weight, model[0].weight)
    assert torch.equal(j_model[1].running_mean, model[1].running_mean)
    served = TrainingState.capture(j_model, j_opt, step=3, epoch=1, hyperparameters={"lr": 0.01})
    assert state_equal(donor, served), state_diff(donor, served)


def test_the_optimizer_state_goes_beside_its_parameter_and_step_stays_on_the_cpu() -> None:
    from chaos.replication.state import _optim_device

    param = torch.empty(3, device="meta")  # a tensor on a device that is not the CPU
    assert _optim_device("exp_avg", param, {}).type == "meta"
    assert _optim_device("step", param, {}).type == "cpu"
    assert _optim_device("step", param, {"capturable": True}).type == "meta"
    assert _optim_device("step", param, {"fused": True}).type == "meta"


@pytest.mark.parametrize("num_samples", [None, 5])
def test_staged_gradients_pack_and_install_as_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch, num_samples: int | None
) -> None:
    results = []
    for stage in (False, True):
        monkeypatch.setattr(gradients, "needs_staging", lambda t, s=stage: s)
        model = _model(1)
        model(torch.randn(4, 5)).sum().backward()
        model[3].bias.grad = None  # a parameter without a gradient counts as zeros
        packer = gradients.GradientPacker(list(model.parameters()))
        flat = packer.pack(num_samples)
        summed = flat + flat  # two members with the same gradients
        packer.install(summed)
        results.append((flat.clone(), [p.grad.clone() for p in model.parameters()]))
    (flat_a, grads_a), (flat_b, grads_b) = results
    assert torch.equal(flat_a, flat_b)
    assert flat_a[-1].item() == (num_samples or 1)
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))


def test_parameters_on_two_devices_are_refused_with_a_clear_error() -> None:
    params = [torch.zeros(2, requires_grad=True), torch.empty(2, device="meta")]
    with pytest.raises(ValueError, match="several devices"):
        gradients.GradientPacker(params)
