"""The training state as one canonical byte stream: layout, zero-copy reads, round trips."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
import torch

from chaos.errors import StateLayoutError
from chaos.replication.state import (
    Manifest,
    TrainingState,
    decode_manifest,
    state_diff,
    state_digest,
    state_equal,
)


def _model(seed: int, hidden: int = 16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, hidden),
        torch.nn.BatchNorm1d(hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 3),
    )


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.99))
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=gen)
        y = torch.randint(0, 3, (8,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _copy_stream(src: TrainingState, dst: TrainingState, chunk: int, seed: int) -> None:
    """Writes src's stream into dst in shuffled chunks (shards arrive in any order)."""
    ranges = [(o, min(chunk, src.total_bytes - o)) for o in range(0, src.total_bytes, chunk)]
    random.Random(seed).shuffle(ranges)
    for off, length in ranges:
        dst.write(off, src.read(off, length))


def _donor(kind: str, steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model(0)
    opt = _optimizer(kind, model)
    _train(model, opt, steps, seed=1)
    return model, opt


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_round_trip_is_bitwise_equal_and_trains_identically(kind: str) -> None:
    model, opt = _donor(kind)
    donor = TrainingState.capture(model, opt, step=3, epoch=2, hyperparameters={"batch": 8})
    j_model = _model(seed=99)  # different weights, an optimizer without any state yet
    j_opt = _optimizer(kind, j_model)
    assert len(j_opt.state) == 0
    joiner = TrainingState.for_joiner(j_model, j_opt, donor.manifest_bytes)
    assert joiner.tensor_sizes() == donor.tensor_sizes()
    assert joiner.layout_fingerprint() == donor.layout_fingerprint()
    _copy_stream(donor, joiner, chunk=97, seed=3)
    runtime = joiner.apply()
    assert (runtime.step, runtime.epoch, runtime.hyperparameters) == (3, 2, {"batch": 8})
    again = TrainingState.capture(
        j_model, j_opt, step=runtime.step, epoch=runtime.epoch, hyperparameters={"batch": 8}
    )
    donor_now = TrainingState.capture(model, opt, step=3, epoch=2, hyperparameters={"batch": 8})
    assert state_diff(donor_now, again) == []
    assert state_equal(donor_now, again)
    assert state_digest(donor_now) == state_digest(again)
    # The optimizer state is really installed: one more step stays bitwise equal.
    _train(model, opt, 1, seed=7)
    _train(j_model, j_opt, 1, seed=7)
    for (name, a), b in zip(model.state_dict().items(), j_model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert j_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    if kind == "adam":
        assert j_opt.param_groups[0]["betas"] == (0.8, 0.99)
        assert isinstance(j_opt.param_groups[0]["betas"], tuple)


def test_stream_order_and_sizes() -> None:
    model, opt = _donor("adam")
    state = TrainingState.capture(model, opt, step=3, epoch=0)
    sizes = state.tensor_sizes()
    assert sum(sizes) == state.total_bytes == state.manifest.total_bytes
    sd = model.state_dict()
    n_model = len(sd)
    assert sizes[:n_model] == [t.numel() * t.element_size() for t in sd.values()]
    m = state.manifest
    assert [s.name for s in m.model] == list(sd)
    # optimizer part: group order, param order, keys sorted; Adam's step is a tensor.
    assert [(s.index, s.key) for s in m.optim[:3]] == [
        (0, "exp_avg"),
        (0, "exp_avg_sq"),
        (0, "step"),
    ]
    assert len(sizes) == n_model + len(m.optim) + 1
    assert sizes[-1] == m.runtime_bytes > 0


def test_read_is_zero_copy_inside_a_tensor_and_gathers_across() -> None:
    model, opt = _donor("sgd")
    state = TrainingState.capture(model, opt, step=3, epoch=0)
    weight = model[0].weight
    view = state.read(0, 8)
    before = bytes(view)
    with torch.no_grad():
        weight.view(-1)[0] += 1.0
    assert bytes(view) != before  # a live view of the parameter's memory
    assert view.readonly
    whole = bytes(state.read(0, state.total_bytes))
    sizes = state.tensor_sizes()
    cut = sizes[0] - 5  # a range across the first two tensors
    assert bytes(state.read(cut, 10)) == whole[cut : cut + 10]
    with pytest.raises(ValueError):
        state.read(state.total_bytes - 1, 2)
    with pytest.raises(ValueError):
        state.read(-1, 1)


def test_joiner_state_replaced_even_where_donor_has_none() -> None:
    model = _model(0)
    opt = _optimizer("adam", model)  # donor before its first step: no optimizer state
    donor = TrainingState.capture(model, opt, step=0, epoch=1)
    assert donor.manifest.optim == []
    j_model, j_opt = _donor("adam")  # a joiner with stale state of its own
    assert len(j_opt.state) > 0
    joiner = TrainingState.for_joiner(j_model, j_opt, donor.manifest)
    _copy_stream(donor, joiner, chunk=1000, seed=0)
    joiner.apply()
    assert len(j_opt.state) == 0
    assert state_equal(
        TrainingState.capture(model, opt, step=0, epoch=1),
        TrainingState.capture(j_model, j_opt, step=0, epoch=1),
    )


def test_rng_states_travel() -> None:
    model, opt = _donor("adam")
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    donor = TrainingState.capture(model, opt, step=3, epoch=0)
    expected = (torch.rand(4), random.random(), np.random.rand(3))
    torch.manual_seed(6)
    random.seed(6)
    np.random.seed(6)
    j_model = _model(1)
    joiner = TrainingState.for_joiner(j_model, _optimizer("adam", j_model), donor.manifest_bytes)
    _copy_stream(donor, joiner, chunk=4096, seed=1)
    joiner.apply()
    assert torch.equal(torch.rand(4), expected[0])
    assert random.random() == expected[1]
    assert np.array_equal(np.random.rand(3), expected[2])


def test_layout_mismatch_is_refused() -> None:
    model, opt = _donor("adam")
    donor = TrainingState.capture(model, opt, step=3, epoch=0)
    wider = _model(0, hidden=17)
    with pytest.raises(StateLayoutError, match="model tensor"):
        TrainingState.for_joiner(wider, _optimizer("adam", wider), donor.manifest_bytes)
    same = _model(0)
    with pytest.raises(StateLayoutError, match="optimizer"):
        TrainingState.for_joiner(same, _optimizer("sgd", same), donor.manifest_bytes)
    other = torch.nn.Sequential(torch.nn.Linear(6, 3))
    with pytest.raises(StateLayoutError, match="model tensors differ"):
        TrainingState.for_joiner(other, _optimizer("adam", other), donor.manifest_bytes)


def test_malformed_or_tampered_manifest_is_refused() -> None:
    model, opt = _donor("adam")
    donor = TrainingState.capture(model, opt, step=3, epoch=0)
    with pytest.raises(StateLayoutError, match="malformed"):
        decode_manifest(b"\xc1not msgpack")
    m = decode_manifest(donor.manifest_bytes)
    bigger = msgspec.structs.replace(m, runtime_bytes=m.runtime_bytes + 1)
    with pytest.raises(StateLayoutError, match="total_bytes"):
        decode_manifest(msgspec.msgpack.encode(bigger))
    spec = m.model[0]
    tampered: Manifest = msgspec.structs.replace(
        m, model=[msgspec.structs.replace(spec, dtype="float64"), *m.model[1:]]
    )
    with pytest.raises(StateLayoutError):
        decode_manifest(msgspec.msgpack.encode(tampered))
    with pytest.raises(StateLayoutError, match="version"):
        decode_manifest(msgspec.msgpack.encode(msgspec.structs.replace(m, version=99)))
    j_model = _model(0)
    with pytest.raises(StateLayoutError, match="dtype"):
        bad = msgspec.structs.replace(
            m, model=[msgspec.structs.replace(spec, dtype="object"), *m.model[1:]]
        )
        TrainingState.for_joiner(j_model, _optimizer("adam", j_model), msgspec.msgpack.encode(bad))


def test_apply_refuses_an_incomplete_stream_and_changes_nothing() -> None:
    model, opt = _donor("adam")
    donor = TrainingState.capture(model, opt, step=3, epoch=0)
    j_model, j_opt = _donor("sgd")
    j_model = _model(4)
    j_opt = _optimizer("adam", j_model)
    joiner = TrainingState.for_joiner(j_model, j_opt, donor.manifest_bytes)
    joiner.write(0, donor.read(0, 100))
    joiner.write(200, donor.read(200, donor.total_bytes - 200))
    assert joiner.missing() == [(100, 100)]
    lr = j_opt.param_groups[0]["lr"]
    with pytest.raises(StateLayoutError, match="100 bytes"):
        joiner.apply()
    assert len(j_opt.state) == 0 and j_opt.param_groups[0]["lr"] == lr
    with pytest.raises(ValueError):
        joiner.write(donor.total_bytes - 3, b"1234")
    joiner.write(100, donor.read(100, 100))
    joiner.apply()


def test_runtime_record_garbage_is_refused() -> None:
    model, opt = _donor("sgd")
    donor = TrainingState.capture(model, opt, step=3, epoch=0)
    j_model = _model(2)
    j_opt = _optimizer("sgd", j_model)
    joiner = TrainingState.for_joiner(j_model, j_opt, donor.manifest_bytes)
    _copy_stream(donor, joiner, chunk=512, seed=2)
    start = donor.total_bytes - donor.manifest.runtime_bytes
    joiner.write(start, b"\xff" * 8)
    rng = torch.get_rng_state()
    with pytest.raises(StateLayoutError, match="runtime record"):
        joiner.apply()
    assert torch.equal(torch.get_rng_state(), rng)
    assert len(j_opt.state) == 0


def test_state_diff_finds_one_flipped_bit() -> None:
    a_model, a_opt = _donor("adam")
    b_model, b_opt = _donor("adam")
    a = TrainingState.capture(a_model, a_opt, step=3, epoch=0)
    b = TrainingState.capture(b_model, b_opt, step=3, epoch=0)
    assert state_equal(a, b)
    state = b_opt.state[b_model[3].bias]["exp_avg_sq"]
    raw = state.view(torch.int32)
    raw[1] ^= 1
    assert state_diff(a, b) == ["optim/0/5/exp_avg_sq differs"]
    c = TrainingState.capture(b_model, b_opt, step=4, epoch=0)
    raw[1] ^= 1
    assert state_diff(a, c) == ["runtime differs"]


def test_unsupported_state_is_refused_clearly() -> None:
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1))
    with pytest.raises(TypeError, match="param_groups"):
        TrainingState.capture(model, opt, step=0, epoch=0)
    with pytest.raises(TypeError, match="hyperparameters"):
        TrainingState.capture(
            model, _optimizer("sgd", model), step=0, epoch=0, hyperparameters={"f": object()}
        )
    lin = torch.nn.Linear(4, 4)
    lin.weight = torch.nn.Parameter(torch.randn(4, 4).t())  # not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        TrainingState.capture(lin, torch.optim.SGD(lin.parameters(), lr=0.1), step=0, epoch=0)
    with pytest.raises(ValueError):
        TrainingState.capture(model, _optimizer("sgd", model), step=-1, epoch=0)
