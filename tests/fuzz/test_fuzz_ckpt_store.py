"""Fuzzing the checkpoint store's reader (:func:`chaos.emulate.ckpt_store.fetch`) with a fake
store that sends arbitrary bytes over a real loopback connection.

The contract: the whole, intact checkpoint, or
:class:`~chaos.emulate.ckpt_store.CheckpointFetchError`
(:class:`~chaos.emulate.ckpt_store.StoreTimeout` when the store stalls); a header that
announces a huge payload allocates nothing before the bytes come.
"""

from __future__ import annotations

import hashlib
import socket
import threading
from collections.abc import Iterator

import pytest
from fuzz_strategies import byte_mutations
from hypothesis import given, settings
from hypothesis import strategies as st

from chaos.emulate.ckpt_store import (
    HEADER,
    MAGIC,
    MAX_CHECKPOINT_BYTES,
    VERSION,
    CheckpointFetchError,
    StoreTimeout,
    fetch,
)

_PAYLOAD = bytes(range(256)) * 3
_VALID = HEADER.pack(MAGIC, VERSION, len(_PAYLOAD), hashlib.sha256(_PAYLOAD).digest()) + _PAYLOAD


class _FakeStore:
    """A listener that answers each connection with the bytes it is given, then closes."""

    def __init__(self) -> None:
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._srv.getsockname()[1])
        self.send = b""
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.sendall(self.send)
                except OSError:
                    pass

    def close(self) -> None:
        self._srv.close()
        self._thread.join(5.0)


@pytest.fixture(scope="module")
def store() -> Iterator[_FakeStore]:
    s = _FakeStore()
    try:
        yield s
    finally:
        s.close()


def check_fetch(store: _FakeStore, raw: bytes) -> bytes | None:
    """The property: the checkpoint when ``raw`` is a valid one, else a refusal."""
    store.send = raw
    try:
        got = fetch("127.0.0.1", store.port, timeout_s=5.0)
    except (CheckpointFetchError, StoreTimeout):
        return None
    magic, version, size, digest = HEADER.unpack(raw[: HEADER.size])
    assert (magic, version) == (MAGIC, VERSION)
    assert got == raw[HEADER.size : HEADER.size + size]
    assert hashlib.sha256(got).digest() == digest
    return got


def test_valid(store: _FakeStore) -> None:
    assert check_fetch(store, _VALID) == _PAYLOAD


@settings(max_examples=200)
@given(raw=st.binary(max_size=200))
def test_random_bytes(store: _FakeStore, raw: bytes) -> None:
    check_fetch(store, raw)


@settings(max_examples=300)
@given(data=st.data())
def test_mutations(store: _FakeStore, data: st.DataObject) -> None:
    got = check_fetch(store, data.draw(byte_mutations(_VALID)))
    assert got in (None, _PAYLOAD)


@settings(max_examples=200)
@given(
    magic=st.sampled_from([MAGIC, b"CKPU", b"\x00" * 4]),
    version=st.integers(0, 2**16 - 1),
    size=st.one_of(
        st.integers(0, 2 * len(_PAYLOAD)),
        st.sampled_from([MAX_CHECKPOINT_BYTES, MAX_CHECKPOINT_BYTES + 1, 2**64 - 1, 2**63]),
    ),
    right_digest=st.booleans(),
)
def test_header_fields(
    store: _FakeStore, magic: bytes, version: int, size: int, right_digest: bool
) -> None:
    """Every header field; a size up to the cap is refused as soon as the stream ends (it used
    to allocate the whole announced size first)."""
    body = _PAYLOAD[:size]
    digest = hashlib.sha256(body).digest() if right_digest else b"\x00" * 32
    got = check_fetch(store, HEADER.pack(magic, version, size, digest) + body)
    valid = (magic, version, right_digest) == (MAGIC, VERSION, True) and size <= len(_PAYLOAD)
    assert (got is not None) == valid
