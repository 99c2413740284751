"""The stop-resume baseline's checkpoint store: one device serves the checkpoint over the network.

Pollux-style stop-resume writes a checkpoint to shared storage, stops every worker, and restarts
all of them (and the new one) from that checkpoint. An edge cluster has no machine besides its
devices, so the emulation places the store on one device: it writes the checkpoint to its own
disk, and every other restarted device, the joiner included, reads it over the emulated links
(multi-hop where it is not a neighbour), as it would read from a network file system.

Wire format (one version, no pickle): on connect the store sends a fixed header and then the
file. The header is ``MAGIC`` (4 bytes), the version (uint16), the payload size (uint64) and the
payload's SHA-256 (32 bytes), little-endian (see :mod:`chaos.wire`). The reader checks all four
and refuses anything else.

Run the store with ``python -m chaos.emulate.ckpt_store --file PATH --listen HOST:PORT
--ready FLAG``; it serves every connection until it is stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import socket
import sys
import threading
import time
from pathlib import Path

from chaos.errors import ChaosError, ChaosTimeout
from chaos.wire import CHECKPOINT_HEADER as HEADER
from chaos.wire import CHECKPOINT_MAGIC as MAGIC
from chaos.wire import CHECKPOINT_VERSION as VERSION

__all__ = ["CheckpointFetchError", "StoreTimeout", "fetch", "serve"]

MAX_CHECKPOINT_BYTES = 64 << 30
CHUNK_BYTES = 1 << 20
DEFAULT_TIMEOUT_S = 600.0


class CheckpointFetchError(ChaosError):
    """The store sent something other than a whole, intact checkpoint of this version."""


class StoreTimeout(ChaosTimeout):
    """The store did not answer or the transfer did not finish within its timeout."""


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytearray:
    """Reads exactly ``n`` bytes. The buffer grows as they arrive: a header that announces a
    huge size allocates nothing before the bytes are there."""
    buf = bytearray()
    chunk = bytearray(min(CHUNK_BYTES, n))
    view = memoryview(chunk)
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise StoreTimeout(f"checkpoint transfer stalled after {len(buf)} of {n} bytes")
        sock.settimeout(left)
        try:
            k = sock.recv_into(view, min(CHUNK_BYTES, n - len(buf)))
        except TimeoutError as exc:
            raise StoreTimeout(
                f"checkpoint transfer stalled after {len(buf)} of {n} bytes"
            ) from exc
        if k == 0:
            raise CheckpointFetchError(f"store closed the connection after {len(buf)} of {n} bytes")
        buf += view[:k]
    return buf


def fetch(host: str, port: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> bytes:
    """Reads the whole checkpoint from the store at ``host:port``.

    Args:
        host: The store device's address.
        port: Its port.
        timeout_s: Limit for the connection and the whole transfer, seconds.

    Returns:
        The checkpoint's bytes, with size and SHA-256 verified.

    Raises:
        StoreTimeout: no connection, or the transfer did not finish, within ``timeout_s``.
        CheckpointFetchError: bad magic, version, size or checksum, or a short transfer.
        OSError: the connection was refused or reset.
    """
    deadline = time.monotonic() + timeout_s
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except TimeoutError as exc:
        raise StoreTimeout(f"no connection to the checkpoint store {host}:{port}") from exc
    with sock:
        head = bytes(_recv_exact(sock, HEADER.size, deadline))
        magic, version, size, digest = HEADER.unpack(head)
        if magic != MAGIC:
            raise CheckpointFetchError(f"not a checkpoint store (magic {magic!r})")
        if version != VERSION:
            raise CheckpointFetchError(f"store speaks version {version}, this reader {VERSION}")
        if size > MAX_CHECKPOINT_BYTES:
            raise CheckpointFetchError(f"checkpoint of {size} bytes is over the cap")
        data = _recv_exact(sock, size, deadline)
    if hashlib.sha256(data).digest() != digest:
        raise CheckpointFetchError("checkpoint checksum mismatch")
    return bytes(data)


def serve(path: Path, host: str, port: int, ready: Path | None = None) -> None:
    """Serves ``path`` to every connection (one thread each) until the process is stopped.

    Args:
        path: The checkpoint file; read once, at start.
        host: Address to bind.
        port: Port to bind.
        ready: A file created once the store listens (the harness waits for it).

    Raises:
        OSError: the address cannot be bound.
    """
    payload = path.read_bytes()
    header = HEADER.pack(MAGIC, VERSION, len(payload), hashlib.sha256(payload).digest())
    srv = socket.create_server((host, port))
    if ready is not None:
        ready.touch()

    def send(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(DEFAULT_TIMEOUT_S)
            try:
                conn.sendall(header)
                conn.sendall(payload)
            except OSError as exc:
                print(f"checkpoint store: a reader went away: {exc}", file=sys.stderr)

    with srv:
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=send, args=(conn,), daemon=True).start()


def _parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"--listen wants HOST:PORT, got {text!r}")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    """``python -m chaos.emulate.ckpt_store``: serve a checkpoint file."""
    ap = argparse.ArgumentParser(prog="python -m chaos.emulate.ckpt_store")
    ap.add_argument("--file", type=Path, required=True, help="the checkpoint to serve")
    ap.add_argument("--listen", type=_parse_listen, required=True, help="HOST:PORT to bind")
    ap.add_argument("--ready", type=Path, default=None, help="file to create once listening")
    args = ap.parse_args(argv)
    if not args.file.is_file():
        ap.error(f"no checkpoint file {args.file}")
    host, port = args.listen
    serve(args.file, host, port, args.ready)
    return 0


if __name__ == "__main__":
    sys.exit(main())
