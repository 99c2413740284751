"""The emulated device's stand-in model: what a content-addressed join finds already in place.

The chunk addresses come from the replication code itself (``TrainingState``), so these tests
check the stand-in against the stream a joiner really hashes.
"""

from __future__ import annotations

import bisect
import itertools

import pytest
import torch

from chaos.emulate.stand_in import (
    DRIFT_STRIDE_BYTES,
    StandInConfig,
    StandInKind,
    StandInModel,
    kind_for,
    state_digest,
)
from chaos.models import model_summary
from chaos.replication.manifest import CHUNK_BYTES, chunk_ranges
from chaos.replication.state import TrainingState

SCALE = 0.004  # gpt2-lora: a 2 MB base, resnet101: a 1.4 MB store (6 chunks)


def _addresses(model: StandInModel, opt: torch.optim.Optimizer) -> dict[str, list[bytes]]:
    """The content addresses of each model tensor's chunks, by tensor name."""
    state = TrainingState.capture(model, opt, step=0, epoch=1)
    specs = state.manifest.model
    sizes = state.tensor_sizes()
    starts = list(itertools.accumulate(sizes, initial=0))
    per: dict[str, list[bytes]] = {spec.name: [] for spec in specs}
    for (off, _), addr in zip(chunk_ranges(sizes, CHUNK_BYTES), state.chunk_addresses(),
                              strict=True):  # fmt: skip
        i = bisect.bisect_right(starts, off) - 1
        if i < len(specs):
            per[specs[i].name].append(addr)
    return per


def _train_step(model: StandInModel, opt: torch.optim.Optimizer) -> None:
    gen = torch.Generator().manual_seed(7)
    x, y = torch.randn(8, 32, generator=gen), torch.randint(0, 8, (8,), generator=gen)
    opt.zero_grad()
    model.loss(x, y).backward()
    opt.step()
    model.drift()


def test_the_model_name_picks_the_kind() -> None:
    assert kind_for("gpt2-lora") is StandInKind.LORA
    assert kind_for("synthetic:8") is StandInKind.FROZEN
    for name in ("resnet101", "gpt2-small", "vgg11"):
        assert kind_for(name) is StandInKind.FULL


@pytest.mark.parametrize("model", ["synthetic:2", "resnet101"])
def test_a_fresh_store_differs_on_every_device(model: str) -> None:
    a = StandInModel(StandInConfig(model, SCALE if model != "synthetic:2" else 1.0, "n0"))
    b = StandInModel(StandInConfig(model, SCALE if model != "synthetic:2" else 1.0, "n1"))
    again = StandInModel(StandInConfig(model, SCALE if model != "synthetic:2" else 1.0, "n0"))
    assert a.store.numel() == b.store.numel() > 0
    assert not torch.equal(a.store, b.store)
    assert torch.equal(a.store, again.store)  # seeded by the id: the same device, the same init
    # no chunk of one device's store has the other's address: a fresh joiner pulls it all
    addr_a = _addresses(a, a.optimizer())["store"]
    addr_b = _addresses(b, b.optimizer())["store"]
    assert not set(addr_a) & set(addr_b)


def test_the_state_has_the_model_size_times_the_scale() -> None:
    cfg = StandInConfig("resnet101", SCALE, "n0")
    model = StandInModel(cfg)
    opt = model.optimizer()
    _train_step(model, opt)  # momentum buffers exist from the first step
    total = TrainingState.capture(model, opt, step=1, epoch=1).total_bytes
    target = model_summary("resnet101")["state_bytes"] * SCALE
    assert abs(total - target) / target < 0.01


def test_a_lora_base_is_shared_and_its_adapters_are_not() -> None:
    a = StandInModel(StandInConfig("gpt2-lora", SCALE, "n0"))
    b = StandInModel(StandInConfig("gpt2-lora", SCALE, "n1"))
    assert torch.equal(a.store, b.store)  # the base checkpoint every device has on disk
    assert a.adapters is not None and b.adapters is not None
    assert not torch.equal(a.adapters, b.adapters)
    assert a.store.numel() * 4 == int(model_summary("gpt2-small")["param_bytes"] * SCALE) // 4 * 4
    assert a.adapters.numel() == round(model_summary("gpt2-lora")["params"] * SCALE)
    addr_a, addr_b = _addresses(a, a.optimizer()), _addresses(b, b.optimizer())
    assert addr_a["store"] == addr_b["store"]
    assert not set(addr_a["adapters"]) & set(addr_b["adapters"])
    # a device without the base on disk starts from its own random base
    c = StandInModel(StandInConfig("gpt2-lora", SCALE, "n2", base_on_disk=False))
    assert not torch.equal(a.store, c.store)


def test_lora_trains_the_adapters_and_keeps_the_base() -> None:
    model = StandInModel(StandInConfig("gpt2-lora", SCALE, "n0"))
    opt = model.optimizer()
    assert isinstance(opt, torch.optim.AdamW)
    assert model.adapters is not None
    base, adapters = model.store.clone(), model.adapters.detach().clone()
    _train_step(model, opt)
    assert torch.equal(model.store, base)
    assert (model.adapters.detach() != adapters).all()  # every element has a gradient
    assert set(opt.state[model.adapters]) == {"step", "exp_avg", "exp_avg_sq"}


def test_a_full_fine_tune_changes_every_chunk_every_step() -> None:
    assert DRIFT_STRIDE_BYTES == CHUNK_BYTES
    model = StandInModel(StandInConfig("resnet101", SCALE, "n0"))
    opt = model.optimizer()
    _train_step(model, opt)
    before = _addresses(model, opt)["store"]
    digest = state_digest(model, opt)
    model.drift()
    after = _addresses(model, opt)["store"]
    assert len(before) == len(after) > 4
    assert all(x != y for x, y in zip(before, after, strict=True))
    assert state_digest(model, opt) != digest  # the digest sees the drift


def test_frozen_and_lora_stores_do_not_drift() -> None:
    for model_name, scale in (("synthetic:1", 1.0), ("gpt2-lora", SCALE)):
        model = StandInModel(StandInConfig(model_name, scale, "n0"))
        store = model.store.clone()
        model.drift()
        assert torch.equal(model.store, store)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"model": "resnet9000"}, ValueError),
        ({"scale": 0.0}, ValueError),
        ({"scale": 1.5}, ValueError),
        ({"scale": float("nan")}, ValueError),
        ({"device_id": ""}, ValueError),
        ({"base_on_disk": "yes"}, TypeError),
    ],
)
def test_bad_configs_are_refused(kwargs: dict, error: type[Exception]) -> None:
    args = {"model": "resnet101", "scale": 0.01, "device_id": "n0", **kwargs}
    with pytest.raises(error):
        StandInConfig(**args)
