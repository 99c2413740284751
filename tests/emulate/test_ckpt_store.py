"""The stop-resume checkpoint store: a real server process and real sockets on loopback."""

from __future__ import annotations

import hashlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from chaos.emulate.ckpt_store import (
    HEADER,
    MAGIC,
    VERSION,
    CheckpointFetchError,
    StoreTimeout,
    fetch,
)
from chaos.launch import free_port


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[int, bytes]]:
    payload = bytes(range(256)) * 4096 + b"tail"
    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_bytes(payload)
    port, ready = free_port(), tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-m", "chaos.emulate.ckpt_store", "--file", str(ckpt),
                             "--listen", f"127.0.0.1:{port}", "--ready", str(ready)])  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("the store did not start")
            time.sleep(0.02)
        yield port, payload
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_every_reader_gets_the_whole_checkpoint(store: tuple[int, bytes]) -> None:
    port, payload = store
    got: list[bytes] = []
    threads = [threading.Thread(target=lambda: got.append(fetch("127.0.0.1", port, 30.0)))
               for _ in range(4)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == [payload] * 4


def _fake_store(header: bytes, body: bytes, hold: float = 0.0) -> int:
    srv = socket.create_server(("127.0.0.1", 0))
    port = int(srv.getsockname()[1])

    def one() -> None:
        with srv:
            conn, _ = srv.accept()
            with conn:
                conn.sendall(header + body)
                time.sleep(hold)

    threading.Thread(target=one, daemon=True).start()
    return port


@pytest.mark.parametrize(
    "magic, version, body, match",
    [
        (b"JUNK", VERSION, b"x", "not a checkpoint store"),
        (MAGIC, VERSION + 1, b"x", "version"),
        (MAGIC, VERSION, b"y", "checksum"),
    ],
)
def test_a_bad_header_or_body_is_refused(
    magic: bytes, version: int, body: bytes, match: str
) -> None:
    port = _fake_store(HEADER.pack(magic, version, 1, hashlib.sha256(b"x").digest()), body)
    with pytest.raises(CheckpointFetchError, match=match):
        fetch("127.0.0.1", port, 10.0)


def test_a_short_transfer_is_refused_and_a_stalled_one_times_out() -> None:
    head = HEADER.pack(MAGIC, VERSION, 100, hashlib.sha256(b"x" * 100).digest())
    with pytest.raises(CheckpointFetchError, match="closed the connection"):
        fetch("127.0.0.1", _fake_store(head, b"x" * 10), 10.0)
    with pytest.raises(StoreTimeout):  # a TimeoutError subclass
        fetch("127.0.0.1", _fake_store(head, b"x" * 10, hold=5.0), 0.5)


def test_the_store_cli_refuses_a_missing_file(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "chaos.emulate.ckpt_store", "--file",
                          str(tmp_path / "none"), "--listen", "127.0.0.1:1"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 2 and "no checkpoint file" in res.stderr
