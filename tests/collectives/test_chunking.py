"""How a round cuts its tensor into chunks (:func:`chaos.collectives.algorithms.chunk_elems`):
at most ``chunk_bytes``, at least ``min_chunks`` of them for a tensor of a few chunk sizes, but
never below ``min_chunk_bytes``; the same on every member, since it depends only on the
settings and the tensor."""

from __future__ import annotations

import pytest

from chaos.collectives import CommunicatorConfig
from chaos.collectives.algorithms import chunk_elems

MIB = 1 << 20


def _cfg(**kw: int) -> CommunicatorConfig:
    return CommunicatorConfig(node_id="a", **kw)  # type: ignore[arg-type]


def test_a_large_tensor_takes_full_chunks() -> None:
    assert chunk_elems(_cfg(), 64 * MIB // 4, 4) * 4 == MIB


def test_a_tensor_of_a_few_chunks_is_cut_into_min_chunks() -> None:
    # 4 MiB in 1 MiB chunks would be 4 chunks: a tree could not overlap up and down
    elems = chunk_elems(_cfg(), 4 * MIB // 4, 4)
    assert elems * 4 == 4 * MIB // 32
    assert -(-(4 * MIB // 4) // elems) == 32


def test_chunks_stay_above_the_floor() -> None:
    assert chunk_elems(_cfg(), 1 << 16, 4) * 4 == 64 << 10
    assert chunk_elems(_cfg(min_chunk_bytes=4096), 1 << 16, 4) * 4 == 8192
    # a chunk_bytes below the floor wins
    assert chunk_elems(_cfg(chunk_bytes=1024), 1 << 20, 4) * 4 == 1024


def test_min_chunks_one_keeps_chunk_bytes() -> None:
    assert chunk_elems(_cfg(min_chunks=1), 4 * MIB // 4, 4) * 4 == MIB


def test_the_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="min_chunks"):
        _cfg(min_chunks=0)
    with pytest.raises(ValueError, match="min_chunk_bytes"):
        _cfg(min_chunk_bytes=8)
