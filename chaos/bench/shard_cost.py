"""``chaos-bench shard-cost``: measures the per-shard cost c of the time model on ZeroMQ.

The same payload is sent over TCP loopback between two processes as ``n`` messages of
``payload / n`` bytes, for several ``n``. With the payload fixed, the byte term of the model is
constant, so a least-squares line ``t(n) = a + c * n`` through the median times gives c, the
fixed cost one more shard message adds (framing, syscalls, wake-ups on both ends).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path
from typing import Any

import click
import zmq

from chaos.errors import ChaosTimeout

RECV_TIMEOUT_S = 30.0
FIT_MIN_MESSAGES = 64


def _receiver(endpoint: str) -> None:
    """Child process: counts the frames of each round and acknowledges the round."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.RCVTIMEO, int(RECV_TIMEOUT_S * 1000))
    sock.connect(endpoint)
    try:
        while True:
            header = sock.recv()
            n = int(header)
            if n == 0:
                return
            for _ in range(n):
                sock.recv(copy=False)
            sock.send(b"ok")
    except zmq.Again:
        return
    finally:
        sock.close(linger=0)
        ctx.term()


def _round(sock: zmq.Socket, payload: memoryview, n: int) -> float:
    size = len(payload) // n
    t0 = time.perf_counter()
    sock.send(str(n).encode())
    for i in range(n):
        chunk = payload[i * size : (i + 1) * size if i < n - 1 else len(payload)]
        sock.send(chunk, copy=False)
    if not sock.poll(int(RECV_TIMEOUT_S * 1000)):
        raise ChaosTimeout(f"receiver did not acknowledge within {RECV_TIMEOUT_S} s")
    sock.recv()
    return time.perf_counter() - t0


def measure(payload_bytes: int, counts: list[int], repeats: int) -> dict[str, Any]:
    """Times the rounds and fits the per-shard cost. Returns the JSON-ready result.

    Raises:
        ChaosTimeout: the receiver process stopped answering.
        ValueError: fewer than two message counts are >= ``FIT_MIN_MESSAGES``.
    """
    if len([n for n in counts if n >= FIT_MIN_MESSAGES]) < 2:
        raise ValueError(f"need at least two message counts >= {FIT_MIN_MESSAGES} to fit c")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    proc = mp.get_context("spawn").Process(target=_receiver, args=(f"tcp://127.0.0.1:{port}",))
    proc.start()
    try:
        payload = memoryview(bytearray(payload_bytes))
        _round(sock, payload, 4)  # warm-up: connection set-up and buffers
        med: dict[int, float] = {}
        for n in counts:
            med[n] = statistics.median(_round(sock, payload, n) for _ in range(repeats))
        sock.send(b"0")
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()
        sock.close(linger=0)
        ctx.term()
    # Fit only where sending is message-bound: one huge message cannot overlap the receiver's
    # copy with the sender's, so the smallest counts sit above the line.
    xs = [n for n in med if n >= FIT_MIN_MESSAGES]
    ys = [med[n] for n in xs]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return {
        "payload_bytes": payload_bytes,
        "fit_messages": xs,
        "repeats": repeats,
        "median_s_by_messages": {str(n): t for n, t in med.items()},
        "per_shard_cost_s": slope,
        "intercept_s": my - slope * mx,
        "throughput_bps_one_message": 8 * payload_bytes / med[min(counts)],
    }


@click.command("shard-cost")
@click.option("--payload-mb", type=click.FloatRange(min=1.0), default=32.0, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=7, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def shard_cost_command(payload_mb: float, repeats: int, json_path: Path | None) -> None:
    """Measure the per-shard cost c on ZeroMQ TCP loopback (slope of time vs message count)."""
    counts = [1, 16, 64, 256, 1024, 4096]
    res = measure(int(payload_mb * 2**20), counts, repeats)
    print(f"{'messages':>10}{'median':>12}")
    for n, t in res["median_s_by_messages"].items():
        print(f"{n:>10}{t * 1e3:>10.2f}ms")
    print(
        f"per-shard cost c = {res['per_shard_cost_s'] * 1e6:.1f} us "
        f"(one-message throughput {res['throughput_bps_one_message'] / 1e9:.2f} Gbit/s)"
    )
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(res, indent=1))
        print(f"wrote {json_path}")
