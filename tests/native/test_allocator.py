"""The frame-memory allocator setting (chaos.allocator)."""

from __future__ import annotations

import platform

import pytest

from chaos import allocator


def test_bad_chunk_size_is_refused() -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        allocator.keep_frame_memory(0)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's")
def test_thresholds_are_set_once_and_raised_for_larger_chunks() -> None:
    assert allocator.keep_frame_memory(1 << 20)
    assert allocator._applied is not None and allocator._applied >= 1 << 20
    first = allocator._applied
    assert allocator.keep_frame_memory(1 << 10)  # smaller chunks: already covered
    assert allocator._applied == first
    assert allocator.keep_frame_memory(first * 2)
    assert allocator._applied == first * 2
