"""The int8 wire format end to end: spawned members allreduce over real sockets (ZeroMQ and
payload lanes), several rounds with error feedback; every child is reaped even when a test
fails."""

from __future__ import annotations

import json
import multiprocessing as mp
import queue
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from chaos.bench.compress import WIRES, compress_command
from chaos.collectives import Communicator, CommunicatorConfig, ErrorFeedback, Topology

NUMEL = 20_011  # not a multiple of a block, a chunk or a segment
TAIL = 300  # the last values travel exact (a trainer's sample count and audit digests)
ROUNDS = 6
REPLY_TIMEOUT_S = 60.0
LANE_WARMUP_ROUNDS = 200


def _input(name: str, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step * 1000 + int(name[1:]))
    x = torch.randn(NUMEL, generator=gen) * (1.0 + int(name[1:]))
    x[-TAIL:] = torch.arange(TAIL) * (step + int(name[1:]) + 1)  # whole numbers: any order sums
    return x


def _wait_for_lanes(comm: Communicator, n: int) -> None:
    """Plain rounds until every member's frames take a lane (a lane comes up beside the rounds,
    in its own thread: on a loaded host the first rounds may all go through ZeroMQ). Each round
    sums the members' "my frames took a lane" flags, so all of them stop at the same round."""
    for _ in range(LANE_WARMUP_ROUNDS):
        flag = torch.zeros(1024)
        flag[0] = float(comm.stats.lane_frames_sent > 0)
        if int(comm.allreduce(flag, "sum")[0].item()) == n:
            return
    # the int8 rounds run anyway: the test then fails on its lane check, naming the member


def _worker(name: str, lanes: bool, commands: Any, replies: Any) -> None:
    """One member: binds, says its address, installs the topology it is sent, then runs
    :data:`ROUNDS` int8 mean allreduces with error feedback and replies with what it got."""
    torch.set_num_threads(1)
    comm = Communicator(CommunicatorConfig(name, chunk_bytes=4096, timeout_s=30.0, lanes=lanes,
                                           lane_min_bytes=0, wire_dtype="int8"))  # fmt: skip
    try:
        replies.put(comm.address)
        spec = commands.get(timeout=REPLY_TIMEOUT_S)
        comm.update_topology(Topology(**spec))
        if lanes:
            _wait_for_lanes(comm, len(spec["members"]))
        lane_frames_before = comm.stats.lane_frames_sent
        fb = ErrorFeedback()
        results = []
        for step in range(ROUNDS):
            x = _input(name, step)
            before = x.clone()
            out = comm.allreduce(x, "mean", feedback=fb, exact_tail=TAIL)
            if not torch.equal(x, before):
                raise AssertionError("the input was modified")
            results.append(out.numpy().copy())
        residual = fb.residual(NUMEL - TAIL)
        kept = None if residual is None else residual.numpy().copy()
        sent = comm.stats.lane_frames_sent - lane_frames_before
        replies.put({"results": results, "residual": kept, "lane_frames": sent})
        # close only once every member has its results: a member that closed after its last
        # round could drop the connection a slower neighbour still reads its last frame
        # beside (a closed neighbour reads as a failed one, as it should mid-session)
        commands.get(timeout=REPLY_TIMEOUT_S)
    finally:
        comm.close()


@contextmanager
def _members(n: int, lanes: bool) -> Iterator[tuple[list[str], list[Any], list[Any], list[str]]]:
    ctx = mp.get_context("spawn")
    names = [f"n{i}" for i in range(n)]
    commands = [ctx.Queue() for _ in names]
    replies = [ctx.Queue() for _ in names]
    procs = [ctx.Process(target=_worker, args=(m, lanes, commands[i], replies[i]), daemon=True)
             for i, m in enumerate(names)]  # fmt: skip
    try:
        for p in procs:
            p.start()
        addresses = [r.get(timeout=REPLY_TIMEOUT_S) for r in replies]
        yield names, commands, replies, addresses
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def _run(n: int, kind: str, lanes: bool) -> dict[str, dict[str, Any]]:
    with _members(n, lanes) as (names, commands, replies, addresses):
        addrs = dict(zip(names, addresses, strict=True))
        spec: dict[str, Any] = {"kind": kind, "members": tuple(names), "addresses": addrs,
                                "epoch": 1}  # fmt: skip
        if kind == "ring":
            spec["ring_order"] = tuple(reversed(names))
        else:  # a chain below the root for 3, a binary tree for 4
            spec["parent"] = {m: (None if i == 0 else names[(i - 1) // 2])
                              for i, m in enumerate(names)}  # fmt: skip
        for q in commands:
            q.put(spec)
        out = {}
        for m, r in zip(names, replies, strict=True):
            try:
                out[m] = r.get(timeout=REPLY_TIMEOUT_S)
            except queue.Empty:
                raise AssertionError(f"no result from {m}") from None
        for q in commands:
            q.put("close")
        return out


@pytest.mark.parametrize(
    ("n", "kind", "lanes"),
    [(2, "ring", True), (3, "ring", False), (4, "ring", True),
     (2, "tree", False), (3, "tree", True), (4, "tree", False)],
)  # fmt: skip
def test_int8_allreduce_is_bitwise_equal_close_to_the_mean_and_keeps_the_sum(
    n: int, kind: str, lanes: bool
) -> None:
    got = _run(n, kind, lanes)
    names = sorted(got)
    first = got[names[0]]["results"]
    for m in names[1:]:
        for step in range(ROUNDS):
            assert np.array_equal(got[m]["results"][step], first[step]), (m, step)
    if lanes:
        no_lane = [m for m in names if got[m]["lane_frames"] == 0]
        assert not no_lane, f"int8 frames never took a lane from {no_lane}"
    refs = [np.mean([_input(m, s).numpy().astype(np.float64) for m in names], axis=0)
            for s in range(ROUNDS)]  # fmt: skip
    for step in range(ROUNDS):  # the tail is exact: the float32 mean of whole numbers
        assert np.array_equal(first[step][-TAIL:], refs[step][-TAIL:].astype(np.float32))
    first = [r[:-TAIL] for r in first]
    refs = [r[:-TAIL] for r in refs]
    scale = float(np.abs(refs[0]).max())
    for step in range(ROUNDS):
        err = np.abs(first[step] - refs[step])
        # a few encodings per element, each within half a step of its block (amax / 254)
        assert err.max() < 0.05 * scale, (step, err.max(), scale)
        assert np.sqrt(np.mean(err**2)) < 0.01 * scale
    # error feedback: the running sum of the results is the running sum of the exact means
    # less the members' last residuals (over n): bounded, however many rounds ran
    residuals = sum(got[m]["residual"].astype(np.float64) for m in names) / n
    drift = np.sum(refs, axis=0) - np.sum(first, axis=0, dtype=np.float64)
    np.testing.assert_allclose(drift, residuals, atol=2e-5 * scale)
    assert np.abs(drift).max() < 0.05 * scale


def test_compress_bench_measures_the_formats_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "compress.json"
    res = CliRunner().invoke(
        compress_command, ["--nodes", "2", "--numel", "20000", "--rounds", "6", "--json", str(out)]
    )
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    rows = {(r["kind"], r["wire"]): r for r in data["rows"]}
    assert set(rows) == {(k, w) for k in ("ring", "tree") for w in WIRES}
    for kind in ("ring", "tree"):
        assert all(rows[kind, w]["bitwise_equal"] for w in WIRES)
        # measured from the frames sent: a quarter of float32's bytes, and the block scales
        assert rows[kind, "bfloat16"]["vs_float32"] == pytest.approx(0.5, abs=0.01)
        assert 0.25 < rows[kind, "int8"]["vs_float32"] < 0.26
        assert rows[kind, "float32"]["rel_rms_error"] < 1e-6
        assert rows[kind, "int8"]["rel_rms_error"] < 0.02
        # error feedback keeps the sum of six rounds closer than plain int8 does
        assert rows[kind, "int8"]["drift"] < 0.75 * rows[kind, "int8_no_feedback"]["drift"]
    assert data["codec"]["int8"]["bytes_per_element"] == (20000 + 4 * 79) / 20000  # 79 blocks
