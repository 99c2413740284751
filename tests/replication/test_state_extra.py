"""The extra state objects in the training-state stream: LR schedulers, a GradScaler, an EMA
model travel with the model and optimizer, bitwise, and malformed or mismatched extras are
refused with a clear error."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch

from chaos.errors import StateLayoutError
from chaos.replication.state import (
    ExtraEntry,
    TrainingState,
    decode_manifest,
    extra_digest,
    state_equal,
)
from tests.trainer.semantics_worker import Ema  # the EMA the training-semantics worker keeps


def _setup(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 5))
    scaler = torch.amp.GradScaler("cpu", growth_interval=2)
    extra = {"sched": sched, "scaler": scaler, "ema": Ema(model)}
    return model, opt, extra


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, extra: dict[str, Any]) -> None:
    for _ in range(4):
        opt.zero_grad()
        loss = model(torch.randn(3, 4)).square().mean()
        extra["scaler"].scale(loss).backward()
        extra["scaler"].step(opt)
        extra["scaler"].update()
        extra["sched"].step()
        extra["ema"].update(model)


def _transfer(donor: TrainingState, joiner: TrainingState) -> None:
    for off in range(0, donor.total_bytes, 97):
        n = min(97, donor.total_bytes - off)
        joiner.write(off, donor.read(off, n))


def test_extra_state_travels_bitwise() -> None:
    model, opt, extra = _setup(0)
    _train(model, opt, extra)
    donor = TrainingState.capture(model, opt, step=4, epoch=1, extra=extra)
    j_model, j_opt, j_extra = _setup(1)
    joiner = TrainingState.for_joiner(j_model, j_opt, donor.manifest_bytes, j_extra)
    assert joiner.tensor_sizes() == donor.tensor_sizes()
    _transfer(donor, joiner)
    joiner.apply()
    assert j_extra["sched"].state_dict() == extra["sched"].state_dict()
    assert j_extra["scaler"].state_dict() == extra["scaler"].state_dict()
    assert j_extra["ema"].updates == 4
    for n, t in extra["ema"].shadow.items():
        assert torch.equal(j_extra["ema"].shadow[n], t)
    assert extra_digest(j_extra) == extra_digest(extra)
    again = TrainingState.capture(j_model, j_opt, step=4, epoch=1, extra=j_extra)
    # the runtime records hold each process's RNG: compare everything but them
    assert [d for d in _diff(donor, again) if d != "runtime differs"] == []
    # one more step each: still equal
    torch.manual_seed(5)
    _train(model, opt, extra)
    torch.manual_seed(5)
    _train(j_model, j_opt, j_extra)
    assert extra_digest(j_extra) == extra_digest(extra)
    assert j_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def _diff(a: TrainingState, b: TrainingState) -> list[str]:
    from chaos.replication.state import state_diff

    return state_diff(a, b)


def test_served_extra_bytes_do_not_change_with_the_object() -> None:
    model, opt, extra = _setup(0)
    donor = TrainingState.capture(model, opt, step=0, epoch=0, extra=extra)
    before = bytes(donor.read(0, donor.total_bytes))
    extra["ema"].update(torch.nn.Sequential(*[m for m in model]))
    with torch.no_grad():
        for t in extra["ema"].shadow.values():
            t.add_(1.0)
    assert bytes(donor.read(0, donor.total_bytes)) == before
    assert state_equal(donor, donor)


def test_joiner_with_other_extra_objects_is_refused() -> None:
    model, opt, extra = _setup(0)
    donor = TrainingState.capture(model, opt, step=0, epoch=0, extra=extra)
    j_model, j_opt, j_extra = _setup(1)
    del j_extra["ema"]
    with pytest.raises(StateLayoutError, match="extra state objects"):
        TrainingState.for_joiner(j_model, j_opt, donor.manifest_bytes, j_extra)
    with pytest.raises(StateLayoutError, match="extra state objects"):
        TrainingState.for_joiner(j_model, j_opt, donor.manifest_bytes)


def test_extra_state_that_is_not_plain_is_refused() -> None:
    model, opt, _ = _setup(0)

    class Odd:
        def state_dict(self) -> dict[str, Any]:
            return {"when": object()}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    with pytest.raises(TypeError, match="odd/when"):
        TrainingState.capture(model, opt, step=0, epoch=0, extra={"odd": Odd()})


def test_refused_load_leaves_the_optimizer_untouched() -> None:
    model, opt, extra = _setup(0)
    _train(model, opt, extra)
    donor = TrainingState.capture(model, opt, step=4, epoch=0, extra=extra)
    j_model, j_opt, j_extra = _setup(1)

    class Refuses(Ema):
        def load_state_dict(self, state: dict[str, Any]) -> None:
            raise ValueError("no")

    j_extra["ema"] = Refuses(j_model)
    joiner = TrainingState.for_joiner(j_model, j_opt, donor.manifest_bytes, j_extra)
    _transfer(donor, joiner)
    with pytest.raises(StateLayoutError, match="'ema' refused"):
        joiner.apply()
    assert not j_opt.state


@pytest.mark.parametrize(
    "state",
    [["X", 5], ["Q", []], ["D", [["a"]]], ["D", [[["L", []], 1]]], ["X", True]],
)
def test_malformed_extra_encodings_are_refused(state: Any) -> None:
    model, opt, extra = _setup(0)
    donor = TrainingState.capture(model, opt, step=0, epoch=0, extra={"ema": extra["ema"]})
    m = donor.manifest
    forged = msgspec.structs.replace(m, extra=[ExtraEntry(name="ema", state=state)])
    raw = msgspec.msgpack.encode(forged)
    with pytest.raises(StateLayoutError):
        decoded = decode_manifest(raw)
        joiner = TrainingState.for_joiner(*_setup(1)[:2], decoded, {"ema": Ema(model)})
        _transfer(donor, joiner)
        joiner.apply()
