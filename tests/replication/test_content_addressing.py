"""Content-addressed state: a joiner keeps the chunks it already holds and needs only the rest.

The manifest carries a 128-bit SHA-256 address per chunk (each stream element cut on its own into
``chunk_bytes`` pieces); ``TrainingState.for_joiner`` hashes what the joiner holds and
``missing()`` lists only the chunks that differ.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from chaos.errors import StateLayoutError
from chaos.replication import staging
from chaos.replication.manifest import chunk_ranges, decode_manifest
from chaos.replication.state import TrainingState, state_diff, state_equal


class LoRALinear(torch.nn.Module):
    """A frozen base layer plus a trainable low-rank adapter (``W + B @ A``)."""

    def __init__(self, n: int, rank: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(0)  # the base checkpoint every device has on disk
        self.base = torch.nn.Linear(n, n)
        self.base.requires_grad_(False)
        torch.manual_seed(seed)  # adapters: each device's own initialisation
        self.a = torch.nn.Parameter(torch.randn(rank, n) * 0.01)
        self.b = torch.nn.Parameter(torch.zeros(n, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a.t() @ self.b.t()


def _lora(seed: int, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = LoRALinear(1024, 4, seed)
    opt = torch.optim.AdamW([model.a, model.b], lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 1024, generator=gen)).pow(2).mean().backward()
        opt.step()
    return model, opt


def _full(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 256, generator=gen)).sum().backward()
        opt.step()


def _fill_missing(donor: TrainingState, joiner: TrainingState) -> int:
    pulled = 0
    for off, length in joiner.missing():
        joiner.write(off, donor.read(off, length))
        pulled += length
    return pulled


def test_a_lora_joiner_with_the_base_weights_pulls_only_the_adapters_and_their_optimizer() -> None:
    model, opt = _lora(seed=1, steps=3)
    donor = TrainingState.capture(model, opt, step=3, epoch=1)
    j_model, j_opt = _lora(seed=2, steps=0)  # same base on disk, fresh adapters, no Adam state
    joiner = TrainingState.for_joiner(j_model, j_opt, donor.manifest_bytes)
    sizes = dict(zip([s.name for s in donor.manifest.model], donor.tensor_sizes(), strict=False))
    base = sizes["base.weight"] + sizes["base.bias"]
    assert joiner.reused_bytes == base  # the base, bitwise, and nothing else
    pulled = _fill_missing(donor, joiner)
    assert pulled == donor.total_bytes - base
    assert pulled <= 0.05 * donor.total_bytes
    joiner.apply()
    again = TrainingState.capture(j_model, j_opt, step=3, epoch=1)
    assert state_equal(donor, again), state_diff(donor, again)


def test_a_returning_device_pulls_only_what_changed_since_it_left() -> None:
    model, opt = _lora(seed=1, steps=3)
    old = TrainingState.capture(model, opt, step=3, epoch=1)
    old_bytes = bytes(old.read(0, old.total_bytes))
    back_model, back_opt = _lora(seed=1, steps=0)  # the device comes back with its old state
    restored = TrainingState.for_joiner(back_model, back_opt, old.manifest_bytes, reuse=False)
    restored.write(0, old_bytes)
    restored.apply()
    gen = torch.Generator().manual_seed(9)
    for _ in range(2):  # the cluster trains on without it
        opt.zero_grad()
        model(torch.randn(8, 1024, generator=gen)).pow(2).mean().backward()
        opt.step()
    donor = TrainingState.capture(model, opt, step=5, epoch=2)
    joiner = TrainingState.for_joiner(back_model, back_opt, donor.manifest_bytes)
    sizes = donor.tensor_sizes()
    tensors_end = donor.total_bytes - sizes[-1]  # the runtime record (RNG states) comes last
    now = TrainingState.capture(back_model, back_opt, step=5, epoch=2).chunk_addresses()
    ranges = chunk_ranges(sizes, donor.manifest.chunk_bytes)
    changed = sum(length for (off, length), a, b in zip(ranges, now, donor.manifest.chunks,
                                                        strict=True)
                  if a != b and off < tensors_end)  # fmt: skip
    assert 0 < changed < 0.05 * donor.total_bytes  # the adapters and their optimizer state
    assert donor.total_bytes - joiner.reused_bytes == changed + sizes[-1]
    _fill_missing(donor, joiner)
    joiner.apply()
    assert state_equal(donor, TrainingState.capture(back_model, back_opt, step=5, epoch=2))


def test_a_full_fine_tune_changes_every_trained_chunk() -> None:
    model, opt = _full(0)
    _step(model, opt, 2)
    before = TrainingState.capture(model, opt, step=2, epoch=1).chunk_addresses()
    _step(model, opt, 1)
    after = TrainingState.capture(model, opt, step=3, epoch=1).chunk_addresses()
    assert sum(a != b for a, b in zip(before, after, strict=True)) == len(after)


def test_a_joiner_holding_nothing_alike_reuses_nothing_and_still_ends_equal() -> None:
    model, opt = _full(0)
    _step(model, opt, 2)
    donor = TrainingState.capture(model, opt, step=2, epoch=1)
    j_model, j_opt = _full(5)
    joiner = TrainingState.for_joiner(j_model, j_opt, donor.manifest_bytes)
    assert joiner.reused_bytes == 0
    assert _fill_missing(donor, joiner) == donor.total_bytes
    joiner.apply()
    assert state_equal(donor, TrainingState.capture(j_model, j_opt, step=2, epoch=1))


def test_a_staged_joiner_reuses_what_its_device_model_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(staging, "needs_staging", lambda t: True)
    model, opt = _lora(seed=1, steps=2)
    donor = TrainingState.capture(model, opt, step=2, epoch=1)
    j_model, j_opt = _lora(seed=3, steps=0)
    joiner = TrainingState.for_joiner(j_model, j_opt, donor.manifest_bytes)
    assert joiner.reused_bytes > 0.9 * donor.total_bytes
    _fill_missing(donor, joiner)
    joiner.apply()
    assert state_equal(donor, TrainingState.capture(j_model, j_opt, step=2, epoch=1))


def test_chunks_never_span_two_elements() -> None:
    assert chunk_ranges([10, 0, 5], 4) == [(0, 4), (4, 4), (8, 2), (10, 4), (14, 1)]
    with pytest.raises(ValueError):
        chunk_ranges([3], 0)


def test_a_manifest_with_wrong_chunk_addresses_is_refused() -> None:
    model, opt = _full(0)
    m = TrainingState.capture(model, opt, step=0, epoch=1).manifest
    for bad in (
        msgspec.structs.replace(m, chunks=m.chunks[:-1]),
        msgspec.structs.replace(m, chunks=[*m.chunks[:-1], b"short"]),
        msgspec.structs.replace(m, chunk_bytes=1),
    ):
        with pytest.raises(StateLayoutError):
            decode_manifest(msgspec.msgpack.encode(bad))
        with pytest.raises(StateLayoutError):
            TrainingState.for_joiner(model, opt, bad)


def test_a_lora_joiner_pulls_only_the_missing_chunks_from_real_shard_servers() -> None:
    from chaos.scheduling import Neighbor, plan_missing

    from chaos.replication.pull import PullConfig, pull_state
    from chaos.replication.server import ShardServer

    model, opt = _lora(seed=1, steps=3)
    donor = TrainingState.capture(model, opt, step=3, epoch=1)
    j_model, j_opt = _lora(seed=2, steps=0)
    with ShardServer() as a, ShardServer() as b:
        for server in (a, b):
            server.publish(donor, 1, 3)
        joiner = TrainingState.for_joiner(j_model, j_opt, donor.manifest_bytes)
        nbrs = [Neighbor("a", 0.0, 1e-8), Neighbor("b", 0.0, 1e-8)]
        plan = plan_missing(joiner.missing(), nbrs, 4e-6)
        stats = pull_state(plan, {"a": a.address, "b": b.address}, joiner, 1, 3, 60.0,
                           neighbors=nbrs, config=PullConfig(window=4))  # fmt: skip
    pulled = sum(stats.bytes_per_donor.values())
    assert pulled == donor.total_bytes - joiner.reused_bytes
    assert pulled <= 0.05 * donor.total_bytes
    assert all(stats.bytes_per_donor[d] > 0 for d in ("a", "b"))  # both donors share the rest
    joiner.apply()
    assert state_equal(donor, TrainingState.capture(j_model, j_opt, step=3, epoch=1))


def test_a_plan_for_the_whole_state_is_refused_when_the_joiner_holds_part_of_it() -> None:
    from chaos.scheduling import Neighbor, plan_replication

    from chaos.replication.pull import pull_state

    model, opt = _lora(seed=1, steps=1)
    donor = TrainingState.capture(model, opt, step=1, epoch=1)
    j_model, j_opt = _lora(seed=2, steps=0)
    joiner = TrainingState.for_joiner(j_model, j_opt, donor.manifest_bytes)
    nbrs = [Neighbor("a", 0.0, 1e-8)]
    whole = plan_replication(joiner.tensor_sizes(), nbrs, 4e-6)
    with pytest.raises(StateLayoutError, match="lacks"):
        pull_state(whole, {"a": "tcp://127.0.0.1:9"}, joiner, 1, 1, 5.0, neighbors=nbrs)
