"""``chaos-bench allreduce``: Chaos's allreduce against torch.distributed gloo, side by side.

``N`` processes on loopback each hold one Chaos :class:`~chaos.collectives.Communicator` and one
gloo process group. For every size and repetition, all three allreduces (Chaos ring, Chaos tree,
gloo) run one after the other on the same float32 tensor, each after a gloo barrier, so they share
the same machine state. One repetition's time is the slowest rank's; the figures are medians over
repetitions. ``chaos_s`` is the faster of ring and tree (on loopback the overlay is complete, so
either is a valid sync policy); ``ratio = gloo_s / chaos_s`` (above 1: Chaos is faster).

With ``--secure`` the same repetitions also time ring and tree on communicators with a cluster
key (CURVE links, AES-256-GCM payload lanes, a topology that binds each member to its key):
``secure_s`` and ``secure_ratio = gloo_s / secure_s`` beside the plain figures.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue
import re
import statistics
import time
from pathlib import Path
from typing import Any

import click
import torch

from chaos.bench.allreduce_shaped import reap, shaped_command
from chaos.collectives import Communicator, CommunicatorConfig, Topology
from chaos.launch import free_port
from chaos.security import ClusterKey, Security

_UNITS = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
ALGOS = ("ring", "tree", "gloo")
ZMQ_ALGOS = ("ring_zmq", "tree_zmq")
"""With ``--zmq-baseline``: ring and tree with :attr:`CommunicatorConfig.lanes` off (every chunk
through ZeroMQ), timed in the same repetitions."""
SECURE_ALGOS = ("ring_secure", "tree_secure")
"""With ``--secure``: ring and tree with a cluster key, timed in the same repetitions."""
RESULT_TIMEOUT_S = 1800.0
LOOPBACK_CHUNK_BYTES = 2 << 20
"""Chunk size tuned on loopback (2 MiB beat 256 KiB, 1 MiB and 4 MiB); the library default
(:attr:`CommunicatorConfig.chunk_bytes`, 1 MiB) suits slower edge links better."""


def parse_size(text: str) -> int:
    """Parses ``"16MB"`` (binary units: 1 MB = 2**20 bytes) into bytes.

    Raises:
        click.BadParameter: not a positive size with a B/KB/MB/GB unit, or not a multiple of 4.
    """
    m = re.fullmatch(r"\s*(\d+)\s*(B|KB|MB|GB)\s*", text.upper())
    if not m or int(m.group(1)) <= 0:
        raise click.BadParameter(f"bad size {text!r}: expected e.g. 1MB, 512KB")
    n = int(m.group(1)) * _UNITS[m.group(2)]
    if n % 4:
        raise click.BadParameter(f"size {text!r} is not a whole number of float32 values")
    return n


def _topologies(
    n: int, addrs: dict[str, dict[str, str]], keys: dict[str, str] | None = None
) -> dict[str, Topology]:
    """One topology per Chaos algorithm (``ring``/``tree``, plain, ``_zmq`` or ``_secure``; the
    secure ones name the members' ``keys``)."""
    names = tuple(f"r{i}" for i in range(n))
    parent = {m: (None if i == 0 else names[(i - 1) // 2]) for i, m in enumerate(names)}
    out: dict[str, Topology] = {}
    for algo in addrs:
        k = keys if algo.endswith("_secure") else None
        if algo.startswith("ring"):
            out[algo] = Topology("ring", names, addrs[algo], 1, ring_order=names, keys=k)
        else:
            out[algo] = Topology("tree", names, addrs[algo], 1, parent=parent, keys=k)
    return out


def _worker(rank: int, n: int, port: int, sizes: list[int], repeats: int, chunk_bytes: int,
            keep_memory: bool, lanes: bool, algos: tuple[str, ...], cluster_secret: bytes | None,
            results: Any) -> None:  # fmt: skip
    """One benchmark process: times every algorithm; rank 0 puts the JSON rows on ``results``.

    Ring and tree each get their own communicator with a fixed topology, as in training, where
    the sync policy stays put for many steps; the algorithms still alternate repetition by
    repetition, so all of them see the same machine noise. The ``_secure`` ones share this
    process's keypair and the cluster key ``cluster_secret``.
    """
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, n, rank == 0, timeout=_td(120.0))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=n)
    secure = Security(ClusterKey(cluster_secret)) if cluster_secret is not None else None
    comms = {
        algo: Communicator(CommunicatorConfig(node_id=f"r{rank}", chunk_bytes=chunk_bytes,
                                              timeout_s=120.0, keep_frame_memory=keep_memory,
                                              lanes=lanes and not algo.endswith("_zmq")),
                           security=secure if algo.endswith("_secure") else None)
        for algo in algos if algo != "gloo"
    }  # fmt: skip
    try:
        for algo, comm in comms.items():
            store.set(f"chaos-{algo}-{rank}", comm.address)
        if secure is not None:
            store.set(f"chaos-key-{rank}", secure.public_key)
        addrs = {
            algo: {f"r{i}": store.get(f"chaos-{algo}-{i}").decode() for i in range(n)}
            for algo in comms
        }
        keys = None
        if secure is not None:
            keys = {f"r{i}": store.get(f"chaos-key-{i}").decode() for i in range(n)}
        for algo, topo in _topologies(n, addrs, keys).items():
            comms[algo].update_topology(topo)
        rows: dict[str, dict[str, list[float]]] = {}
        for size in sizes:
            x = torch.randn(size // 4, generator=torch.Generator().manual_seed(rank))
            y = torch.empty_like(x)  # gloo reduces in place: refilled from x before each run
            o = torch.empty_like(x)  # chaos writes its result here (preallocated, like y)
            times: dict[str, list[float]] = {a: [] for a in algos}
            for rep in range(repeats + 1):  # the first repetition warms up and is discarded
                for algo in algos:
                    y.copy_(x)
                    dist.barrier()
                    t0 = time.perf_counter()
                    if algo == "gloo":
                        dist.all_reduce(y)
                    else:
                        comms[algo].allreduce(x, "sum", out=o)
                    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                    if rep:
                        times[algo].append(float(dt.item()))
            rows[str(size)] = times
        if rank == 0:
            results.put(json.dumps(rows))
    finally:
        for comm in comms.values():
            comm.close()
        dist.destroy_process_group()


def _td(seconds: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=seconds)


def run_bench(
    nodes: int,
    sizes: list[int],
    repeats: int,
    chunk_bytes: int,
    keep_memory: bool = True,
    lanes: bool = True,
    zmq_baseline: bool = False,
    secure: bool = False,
) -> dict[str, Any]:
    """Spawns the processes, collects rank 0's timings and returns the JSON-ready result.

    ``keep_memory`` is :attr:`CommunicatorConfig.keep_frame_memory` (process-wide, so the gloo
    side of the same processes runs with the same allocator settings); ``lanes`` is
    :attr:`CommunicatorConfig.lanes` of ``ring`` and ``tree``; ``zmq_baseline`` adds
    :data:`ZMQ_ALGOS` (lanes off) and ``secure`` adds :data:`SECURE_ALGOS` (a cluster key,
    generated for the run) to every repetition.

    Raises:
        RuntimeError: a benchmark process failed or produced nothing.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    algos = ALGOS + (ZMQ_ALGOS if zmq_baseline else ()) + (SECURE_ALGOS if secure else ())
    secret = ClusterKey.generate().secret if secure else None
    args = (nodes, port, sizes, repeats, chunk_bytes, keep_memory, lanes, algos, secret, results)
    procs = [ctx.Process(target=_worker, args=(r, *args)) for r in range(nodes)]
    for p in procs:
        p.start()
    try:
        raw = _await_result(results, procs)
    finally:
        reap(procs)
    rows = json.loads(raw)
    out: dict[str, Any] = {"nodes": nodes, "repeats": repeats, "chunk_bytes": chunk_bytes,
                           "keep_frame_memory": keep_memory, "lanes": lanes, "secure": secure,
                           "dtype": "float32", "op": "sum", "sizes": {}}  # fmt: skip
    for size in sizes:
        med = {a: statistics.median(rows[str(size)][a]) for a in algos}
        best = min(("ring", "tree"), key=lambda a: med[a])
        row = {
            "bytes": size, "chaos_s": med[best], "chaos_algo": best, "ring_s": med["ring"],
            "tree_s": med["tree"], "gloo_s": med["gloo"], "ratio": med["gloo"] / med[best],
        }  # fmt: skip
        if zmq_baseline:
            zbest = min(ZMQ_ALGOS, key=lambda a: med[a])
            row.update(ring_zmq_s=med["ring_zmq"], tree_zmq_s=med["tree_zmq"],
                       zmq_ratio=med["gloo"] / med[zbest])  # fmt: skip
        if secure:
            sbest = min(SECURE_ALGOS, key=lambda a: med[a])
            row.update(ring_secure_s=med["ring_secure"], tree_secure_s=med["tree_secure"],
                       secure_s=med[sbest], secure_algo=sbest.removesuffix("_secure"),
                       secure_ratio=med["gloo"] / med[sbest])  # fmt: skip
        out["sizes"][_label(size)] = row
    return out


def _await_result(results: Any, procs: list[Any]) -> str:
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            return str(results.get(timeout=1.0))
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                codes = [p.exitcode for p in procs]
                raise RuntimeError(f"a benchmark process failed (exit codes {codes})") from None
            if all(p.exitcode == 0 for p in procs):
                raise RuntimeError("benchmark processes exited without a result") from None
    raise RuntimeError(f"no result within {RESULT_TIMEOUT_S} s")


def _label(size: int) -> str:
    for unit in ("GB", "MB", "KB"):
        if size % _UNITS[unit] == 0:
            return f"{size // _UNITS[unit]}{unit}"
    return f"{size}B"


@click.command("allreduce")
@click.option("--nodes", type=click.IntRange(2, 64), default=4, show_default=True,
              help="Processes on loopback.")
@click.option("--sizes", default=None,
              help="Comma-separated tensor sizes (float32; 1MB = 2**20 bytes); default "
                   "1MB,16MB,64MB on loopback, 6MB (one size) with --shaped.")
@click.option("--repeats", type=click.IntRange(1, 1000), default=None,
              help="Timed repetitions per size and algorithm (after one warm-up); default 5 "
                   "on loopback, 3 with --shaped.")
@click.option("--chunk-bytes", type=click.IntRange(64), default=None,
              help="Chaos wire chunk size; default 2 MiB on loopback (tuned there), the "
                   "library's CommunicatorConfig.chunk_bytes with --shaped.")
@click.option("--keep-frame-memory/--no-keep-frame-memory", default=True, show_default=True,
              help="CommunicatorConfig.keep_frame_memory: glibc keeps freed frame buffers "
                   "mapped (process-wide; the default of the library).")
@click.option("--lanes/--no-lanes", default=True, show_default=True,
              help="CommunicatorConfig.lanes of ring and tree: chunks over plain TCP payload "
                   "lanes (the default of the library) or through ZeroMQ.")
@click.option("--zmq-baseline", is_flag=True,
              help="Also time ring and tree with lanes off, in the same repetitions.")
@click.option("--secure", is_flag=True,
              help="Also time ring and tree with a cluster key (CURVE links, AES-256-GCM "
                   "lanes), in the same repetitions, and report their ratio against gloo.")
@click.option("--shaped", is_flag=True,
              help="Instead of loopback: members in network namespaces behind tc-shaped links "
                   "(needs root), against the bandwidth bound; see --members and --mbit.")
@click.option("--members", default="2,4", show_default=True,
              help="With --shaped: comma-separated member counts.")
@click.option("--mbit", default="10,20", show_default=True,
              help="With --shaped: comma-separated link rates, Mbit/s.")
@click.option("--deep-tree", is_flag=True,
              help="With --shaped: also time the tree at more than two members.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Write the results here.")
def allreduce_command(nodes: int, sizes: str | None, repeats: int | None,
                      chunk_bytes: int | None, keep_frame_memory: bool, lanes: bool,
                      zmq_baseline: bool, secure: bool, shaped: bool, members: str, mbit: str,
                      deep_tree: bool, json_path: Path | None) -> None:  # fmt: skip
    """Chaos allreduce (ring and tree) vs torch.distributed gloo, on loopback or (--shaped)
    on tc-shaped links."""
    if shaped:
        size = [parse_size(s) for s in (sizes or "6MB").split(",") if s.strip()]
        if len(size) != 1:
            raise click.BadParameter("--shaped takes one size", param_hint="--sizes")
        shaped_command(size[0], repeats or 3, chunk_bytes, members, mbit, deep_tree, json_path)
        return
    parsed = [parse_size(s) for s in (sizes or "1MB,16MB,64MB").split(",") if s.strip()]
    if not parsed:
        raise click.BadParameter("no sizes given", param_hint="--sizes")
    repeats = repeats or 5
    chunk_bytes = chunk_bytes or LOOPBACK_CHUNK_BYTES
    result = run_bench(nodes, parsed, repeats, chunk_bytes, keep_frame_memory, lanes, zmq_baseline,
                       secure)  # fmt: skip
    click.echo(f"allreduce, {nodes} processes on loopback, float32 sum, median of {repeats}")
    click.echo(f"{'size':>8} {'ring s':>10} {'tree s':>10} {'chaos s':>10} {'gloo s':>10} "
               f"{'ratio':>7}")  # fmt: skip
    for label, row in result["sizes"].items():
        click.echo(f"{label:>8} {row['ring_s']:10.4f} {row['tree_s']:10.4f} "
                   f"{row['chaos_s']:10.4f} {row['gloo_s']:10.4f} {row['ratio']:7.2f}")  # fmt: skip
    if zmq_baseline:
        click.echo(f"{'size':>8} {'ring_zmq s':>10} {'tree_zmq s':>10} {'zmq ratio':>10}")
        for label, row in result["sizes"].items():
            click.echo(f"{label:>8} {row['ring_zmq_s']:10.4f} {row['tree_zmq_s']:10.4f} "
                       f"{row['zmq_ratio']:10.2f}")  # fmt: skip
    if secure:
        click.echo(f"{'size':>8} {'ring sec s':>10} {'tree sec s':>10} {'secure s':>10} "
                   f"{'gloo s':>10} {'ratio':>7} {'sec ratio':>9}")  # fmt: skip
        for label, row in result["sizes"].items():
            click.echo(f"{label:>8} {row['ring_secure_s']:10.4f} {row['tree_secure_s']:10.4f} "
                       f"{row['secure_s']:10.4f} {row['gloo_s']:10.4f} {row['ratio']:7.2f} "
                       f"{row['secure_ratio']:9.2f}")  # fmt: skip
    click.echo("ratio = gloo_s / chaos_s (>= 1: Chaos is faster); chaos = best of ring and tree")
    if secure:
        click.echo("sec ratio = gloo_s / secure_s: the same with a cluster key (CURVE links, "
                   "AES-256-GCM lanes)")  # fmt: skip
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
