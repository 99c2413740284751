"""Fuzzing the training-state stream format (:mod:`chaos.replication.state`): the manifest a
joiner receives from a donor, and the runtime record that ends the stream.

The contracts: :func:`~chaos.replication.state.decode_manifest` and
:meth:`~chaos.replication.state.TrainingState.for_joiner` return or raise
:class:`~chaos.errors.StateLayoutError`; :meth:`~chaos.replication.state.TrainingState.apply`
returns the runtime record or raises :class:`~chaos.errors.StateLayoutError`, and a refused
stream leaves the joiner's optimizer and RNGs as they were.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from fuzz_strategies import (
    byte_mutations,
    deep_array,
    deep_field,
    deep_map,
    field_mutations,
    msgpack_values,
    values,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from chaos.errors import StateLayoutError
from chaos.replication.state import Manifest, RuntimeInfo, TrainingState, decode_manifest


def _pair(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, opt


def _donor() -> TrainingState:
    model, opt = _pair(0)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    return TrainingState.capture(model, opt, step=5, epoch=2, hyperparameters={"bs": 4})


DONOR = _donor()
MANIFEST = bytes(DONOR.manifest_bytes)
_MANIFEST_MAP: dict[str, Any] = msgspec.msgpack.decode(MANIFEST)
_RUNTIME_AT = DONOR.total_bytes - DONOR.manifest.runtime_bytes
RUNTIME = bytes(DONOR.read(_RUNTIME_AT, DONOR.manifest.runtime_bytes))
_RUNTIME_MAP: dict[str, Any] = msgspec.msgpack.decode(RUNTIME)


@pytest.fixture(autouse=True, scope="module")
def _keep_rngs() -> Iterator[None]:
    """Applying a fuzzed runtime record may set the process's RNGs: put them back."""
    saved = (torch.get_rng_state(), random.getstate(), np.random.get_state(legacy=True))
    yield
    torch.set_rng_state(saved[0])
    random.setstate(saved[1])
    np.random.set_state(saved[2])


def check_manifest(raw: bytes) -> Manifest | None:
    """The property of :func:`decode_manifest` and :meth:`TrainingState.for_joiner`."""
    try:
        m = decode_manifest(raw)
    except StateLayoutError:
        m = None
    model, opt = _pair(1)
    try:
        TrainingState.for_joiner(model, opt, raw)
    except StateLayoutError:
        pass
    return m


def _stream(manifest: Manifest, runtime: bytes) -> bytes | None:
    """A joiner receives ``manifest`` and the donor's tensors, then ``runtime``, and applies;
    checks the property and returns what the joiner's optimizer state became (``None`` when
    refused)."""
    model, opt = _pair(1)
    try:
        joiner = TrainingState.for_joiner(model, opt, manifest)
    except StateLayoutError:
        return None
    joiner.write(0, DONOR.read(0, _RUNTIME_AT))
    joiner.write(_RUNTIME_AT, runtime)
    before = (opt.state_dict(), torch.get_rng_state(), random.getstate())
    try:
        info = joiner.apply()
    except StateLayoutError:
        after = (opt.state_dict(), torch.get_rng_state(), random.getstate())
        assert repr(after) == repr(before), "a refused stream changed the joiner"
        return None
    assert isinstance(info, RuntimeInfo)
    return runtime


def check_runtime(runtime: bytes) -> None:
    """A donor sends ``runtime`` as its runtime record (its manifest's length and digest
    match it, as a donor can make them)."""
    manifest = msgspec.structs.replace(
        DONOR.manifest,
        runtime_bytes=len(runtime),
        runtime_digest=hashlib.sha256(runtime).hexdigest(),
        total_bytes=_RUNTIME_AT + len(runtime),
    )
    if len(runtime) <= 16 << 20:
        _stream(manifest, runtime)


def test_the_donors_stream_applies() -> None:
    got = check_manifest(MANIFEST)
    assert got is not None and msgspec.msgpack.encode(got) == MANIFEST
    assert _stream(DONOR.manifest, RUNTIME) == RUNTIME


@settings(max_examples=200)
@given(raw=st.binary(max_size=512))
def test_manifest_random_bytes(raw: bytes) -> None:
    check_manifest(raw)


@settings(max_examples=200)
@given(raw=msgpack_values)
def test_manifest_random_msgpack(raw: bytes) -> None:
    check_manifest(raw)


@settings(max_examples=300)
@given(data=st.data())
def test_manifest_byte_mutations(data: st.DataObject) -> None:
    check_manifest(data.draw(byte_mutations(MANIFEST)))


@settings(max_examples=300)
@given(data=st.data())
def test_manifest_field_mutations(data: st.DataObject) -> None:
    check_manifest(data.draw(field_mutations(_MANIFEST_MAP)))


@pytest.mark.parametrize("key", ["param_groups", "optim_values", "extra", "model"])
def test_manifest_deep_nesting(key: str) -> None:
    check_manifest(deep_array())
    check_manifest(deep_map())
    check_manifest(deep_field(_MANIFEST_MAP, key))


_index = st.one_of(st.integers(0, 3), st.sampled_from([2**63, 2**64 - 1]))


@settings(max_examples=200)
@given(
    entries=st.lists(
        st.tuples(_index, _index, st.text(max_size=8), values), min_size=1, max_size=3
    ),
    hypers=st.lists(st.dictionaries(st.text(max_size=8), values, max_size=3), max_size=3),
    replace_hypers=st.booleans(),
)
def test_manifest_values_outside_the_layout(
    entries: list[tuple[int, int, str, Any]], hypers: list[dict[str, Any]], replace_hypers: bool
) -> None:
    """The optimizer values and the hyperparameters are not part of the layout fingerprint: a
    donor may send any, pointing at params that do not exist or overwriting ``params``."""
    raw = dict(_MANIFEST_MAP, optim_values=[list(e) for e in entries])
    if replace_hypers:
        raw["param_groups"] = hypers
    frame = msgspec.msgpack.encode(raw)
    m = check_manifest(frame)
    if m is not None:
        _stream(m, RUNTIME)


@settings(max_examples=200)
@given(raw=st.binary(max_size=256))
def test_runtime_random_bytes(raw: bytes) -> None:
    check_runtime(raw)


@settings(max_examples=300)
@given(data=st.data())
def test_runtime_byte_mutations(data: st.DataObject) -> None:
    check_runtime(data.draw(byte_mutations(RUNTIME)))


@settings(max_examples=300)
@given(data=st.data())
def test_runtime_field_mutations(data: st.DataObject) -> None:
    check_runtime(data.draw(field_mutations(_RUNTIME_MAP)))


@settings(max_examples=200)
@given(
    part=st.sampled_from(["python_rng", "numpy_rng"]),
    index=st.integers(0, 4),
    value=st.one_of(values, st.sampled_from([2**64 - 1, -1, 2**32, 625, 624])),
)
def test_runtime_rng_states(part: str, index: int, value: Any) -> None:
    """Every element of the Python and numpy RNG states, replaced."""
    rng = list(_RUNTIME_MAP[part])
    if index < len(rng):
        rng[index] = value
        check_runtime(msgspec.msgpack.encode(dict(_RUNTIME_MAP, **{part: rng})))


@settings(max_examples=100)
@given(i=st.integers(0, 623), value=st.sampled_from([2**32, 2**64 - 1, -1, 2**63]))
def test_runtime_python_rng_words(i: int, value: int) -> None:
    version, internal, gauss = _RUNTIME_MAP["python_rng"]
    internal = list(internal)
    internal[i] = value
    runtime = dict(_RUNTIME_MAP, python_rng=[version, internal, gauss])
    check_runtime(msgspec.msgpack.encode(runtime))


@pytest.mark.parametrize("key", ["hyperparameters", "python_rng", "extra"])
def test_runtime_deep_nesting(key: str) -> None:
    check_runtime(deep_array())
    check_runtime(deep_field(_RUNTIME_MAP, key))
