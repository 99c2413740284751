"""``chaos-bench allreduce --shaped``: Chaos's allreduce against gloo on tc-shaped links.

Every member runs in a network namespace of its own (:class:`chaos.emulate.Network`), joined to
a hub namespace by one veth pair shaped with tc ``tbf`` at the case's rate on both ends: a star,
as devices behind home uplinks of ``B`` bit/s each way meet at a switch. A member's traffic to
any other leaves through its own link and arrives through the other's, both at ``B``.

The bound. On such links an allreduce of ``S`` bytes over ``n`` members cannot finish before
each member has sent ``2 (n - 1) / n * S`` bytes through its link (each member must hand out
the ``(n - 1) / n`` of the sum it does not compute, and take in the other members' part of its
own; the ring meets it). For two members that is ``S`` each way at once. The bound is that
traffic at the link's TCP goodput ``G``, measured in the same run with a raw TCP bulk transfer
between two members (tbf meters whole Ethernet frames, so ``G`` is about 95% of the rate)::

    bound_s = 2 (n - 1) / n * S * 8 / G

For every case (members, rate) the same processes time the Chaos ring, the Chaos tree and gloo
(a ``ProcessGroupGloo`` on the member's address) one after the other on the same float32
tensor, each after a barrier; one repetition's time is the slowest member's, the figures are
medians over the repetitions after one warm-up. ``chaos_s`` is the ring at 4 or more members
and the tree at 2, the structure the scheduler's sync policy picks on such an overlay; the
ratios are ``*_bound = time / bound_s`` and ``chaos_vs_gloo = gloo_s / chaos_s``.

The namespaces (named ``<prefix><pid>-<run>-<i>``, unique per run) and the processes are
removed on every exit path.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import queue
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch

from chaos.collectives import Communicator, CommunicatorConfig, Topology
from chaos.emulate.measure import bulk_transfer
from chaos.emulate.netns import in_netns
from chaos.emulate.network import LinkSpec, Network, NetworkConfig

__all__ = ["SHAPED_ALGOS", "ShapedConfig", "bound_s", "run_shaped", "shaped_command"]

SHAPED_ALGOS = ("ring", "tree", "gloo")
HUB = "hub"
STORE_PORT = 29517
"""The rendezvous store's port on the first member's address (its namespace is fresh)."""
MBIT = 1e6


@dataclass(frozen=True)
class ShapedConfig:
    """One run of the shaped-link cases.

    Args:
        members: Member counts, one case each per rate.
        mbits: Link rates in Mbit/s.
        size: Tensor bytes (float32, so a multiple of 4).
        repeats: Timed repetitions per case and algorithm (after one warm-up).
        chunk_bytes: :attr:`CommunicatorConfig.chunk_bytes` (default: the library's).
        queue_s: The tbf queue in seconds of the rate (:attr:`NetworkConfig.queue_s`).
        goodput_s: The raw TCP transfer's measuring window, seconds.
        prefix: Namespace name prefix.
        timeout_s: Longest one case may take (spawn to result).
        deep_tree: Also time the tree at more than two members (by default only at two, where
            it runs as a ring of two). On the star its root's broadcast stalls behind the
            children's reduce (see docs/collectives.md); at 10 Mbit/s a stall outlasted the
            10 s TCP user timeout and failed the round.

    Raises:
        ValueError: an empty or invalid case list, size or count.
    """

    members: tuple[int, ...] = (2, 4)
    mbits: tuple[float, ...] = (10.0, 20.0)
    size: int = 4 << 20
    repeats: int = 3
    chunk_bytes: int = CommunicatorConfig(node_id="x").chunk_bytes
    queue_s: float = 0.05
    goodput_s: float = 2.0
    prefix: str = "chaosbench-"
    timeout_s: float = 600.0
    deep_tree: bool = False

    def __post_init__(self) -> None:
        if not self.members or any(n < 2 or n > 16 for n in self.members):
            raise ValueError(f"members must be counts in [2, 16], got {self.members}")
        if not self.mbits or any(not 0.1 <= b <= 10_000 for b in self.mbits):
            raise ValueError(f"mbits must be rates in [0.1, 10000] Mbit/s, got {self.mbits}")
        if self.size <= 0 or self.size % 4:
            raise ValueError(f"size must be a positive multiple of 4 bytes, got {self.size}")
        if self.repeats < 1 or self.chunk_bytes < 64:
            raise ValueError("repeats must be >= 1 and chunk_bytes >= 64")
        for name in ("queue_s", "goodput_s", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")


def bound_s(members: int, size: int, goodput_bps: float) -> float:
    """The bandwidth bound of an allreduce of ``size`` bytes over ``members`` members, each
    behind a full-duplex link of TCP goodput ``goodput_bps`` (see the module docstring)."""
    return 2 * (members - 1) / members * size * 8 / goodput_bps


def run_shaped(cfg: ShapedConfig) -> dict[str, Any]:
    """Runs every case of ``cfg`` (each on a network of its own) and returns the JSON-ready
    result.

    Raises:
        RootRequiredError: not root (namespaces, veth pairs and tc need it).
        RuntimeError: a benchmark process failed or produced nothing in time.
    """
    cases = [_run_case(cfg, n, mbit) for n in cfg.members for mbit in cfg.mbits]
    return {"shaped": True, "topology": "star: each member one tbf-shaped veth to a hub",
            "size_bytes": cfg.size, "repeats": cfg.repeats, "chunk_bytes": cfg.chunk_bytes,
            "queue_s": cfg.queue_s, "dtype": "float32", "op": "sum",
            "bound": "2 (n - 1) / n * size * 8 / goodput_bps", "cases": cases}  # fmt: skip


def shaped_command(size: int, repeats: int, chunk_bytes: int | None, members: str, mbit: str,
                   deep_tree: bool, json_path: Path | None) -> None:  # fmt: skip
    """``chaos-bench allreduce --shaped``: runs the cases, prints the table, writes the JSON.

    Raises:
        click.BadParameter: a member count or rate that does not parse or validate.
    """
    try:
        cfg = ShapedConfig(
            members=tuple(int(m) for m in members.split(",") if m.strip()),
            mbits=tuple(float(b) for b in mbit.split(",") if b.strip()),
            size=size, repeats=repeats,
            chunk_bytes=chunk_bytes if chunk_bytes is not None else ShapedConfig.chunk_bytes,
            deep_tree=deep_tree,
        )  # fmt: skip
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    result = run_shaped(cfg)
    click.echo(f"allreduce on tc-shaped links (star), {size} bytes float32 sum, median of "
               f"{repeats}; bound = 2(n-1)/n * size / measured TCP goodput")  # fmt: skip
    click.echo(f"{'n':>2} {'Mbit':>5} {'goodput':>8} {'bound s':>8} {'ring s':>7} {'tree s':>7} "
               f"{'gloo s':>7} {'ring/b':>6} {'tree/b':>6} {'gloo/b':>6} {'gloo/chaos':>10}")
    for c in result["cases"]:
        click.echo(f"{c['members']:>2} {c['mbit']:>5g} {c['goodput_bps'] / MBIT:>8.2f} "
                   f"{c['bound_s']:>8.3f} {c['ring_s']:>7.3f} {_fmt(c['tree_s'], 7)} "
                   f"{c['gloo_s']:>7.3f} {c['ring_bound']:>6.3f} {_fmt(c['tree_bound'], 6)} "
                   f"{c['gloo_bound']:>6.3f} {c['chaos_vs_gloo']:>10.3f}")  # fmt: skip
    click.echo("x/b = time / bound; gloo/chaos = gloo_s / chaos_s (>= 1: Chaos is faster), chaos "
               "= the tree at 2 members, the ring at more (the scheduler's picks)")
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2) + "\n")


def _fmt(value: float | None, width: int) -> str:
    return "-".rjust(width) if value is None else f"{value:>{width}.3f}"


def _run_case(cfg: ShapedConfig, n: int, mbit: float) -> dict[str, Any]:
    """One case: builds its star network, measures the goodput, times the algorithms."""
    members = tuple(f"r{i}" for i in range(n))
    net_cfg = NetworkConfig(
        nodes=(HUB, *members), links=tuple(LinkSpec(HUB, m, mbit * MBIT) for m in members),
        queue_s=cfg.queue_s, prefix=cfg.prefix,
    )  # fmt: skip
    with Network(net_cfg) as net:
        good = bulk_transfer(net.ns("r0"), net.ns("r1"), net.address("r1"),
                             duration_s=cfg.goodput_s, warmup_s=0.5)  # fmt: skip
        namespaces = [net.ns(m) for m in members]
        addrs = [net.address(m) for m in members]
        times = _spawn(cfg, namespaces, addrs)
    return _summary(cfg, n, mbit, good.goodput_bps, times)


def _summary(
    cfg: ShapedConfig, n: int, mbit: float, goodput_bps: float, times: dict[str, list[float]]
) -> dict[str, Any]:
    """A case's medians, bound and ratios."""
    bound = bound_s(n, cfg.size, goodput_bps)
    med = {a: statistics.median(times[a]) for a in times}
    chaos_algo = "tree" if n == 2 else "ring"
    row: dict[str, Any] = {
        "members": n, "mbit": mbit, "goodput_bps": goodput_bps,
        "goodput_of_rate": goodput_bps / (mbit * MBIT), "bound_s": bound,
        "chaos_algo": chaos_algo, "chaos_s": med[chaos_algo],
        "chaos_bound": med[chaos_algo] / bound, "chaos_vs_gloo": med["gloo"] / med[chaos_algo],
    }  # fmt: skip
    for a in SHAPED_ALGOS:
        row[f"{a}_s"] = med.get(a)
        row[f"{a}_bound"] = med[a] / bound if a in med else None
    row["times_s"] = times
    return row


def _spawn(cfg: ShapedConfig, namespaces: list[str], addrs: list[str]) -> dict[str, list[float]]:
    """Runs one process per member in its namespace; returns the first member's timings."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    n = len(namespaces)
    procs = [
        ctx.Process(target=_worker, args=(r, namespaces[r], addrs, cfg, results))
        for r in range(n)
    ]
    for p in procs:
        p.start()
    try:
        raw = _await_result(results, procs, cfg.timeout_s)
    finally:
        reap(procs)
    times: dict[str, list[float]] = json.loads(raw)
    return times


def reap(procs: list[Any]) -> None:
    """Waits for the benchmark's member processes (30 s each), killing one that lingers."""
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            p.join()


def _await_result(results: Any, procs: list[Any], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return str(results.get(timeout=1.0))
        except queue.Empty:
            codes = [p.exitcode for p in procs]
            if any(c not in (None, 0) for c in codes):
                raise RuntimeError(f"a benchmark process failed (exit codes {codes})") from None
            if all(c == 0 for c in codes):
                raise RuntimeError("benchmark processes exited without a result") from None
    raise RuntimeError(f"no result within {timeout_s} s")


def _topologies(n: int, book: dict[str, dict[str, str]]) -> dict[str, Topology]:
    """The ring (in member order) and the tree (member ``i``'s parent is ``(i - 1) // 2``)."""
    names = tuple(f"r{i}" for i in range(n))
    parent = {m: (None if i == 0 else names[(i - 1) // 2]) for i, m in enumerate(names)}
    out = {"ring": Topology("ring", names, book["ring"], 1, ring_order=names)}
    if "tree" in book:
        out["tree"] = Topology("tree", names, book["tree"], 1, parent=parent)
    return out


def _worker(rank: int, ns: str, addrs: list[str], cfg: ShapedConfig, results: Any) -> None:
    """One member's process: enters its namespace (every thread it starts later is there too)
    and times the algorithms; the first member puts the timings on ``results``."""
    with in_netns(ns):
        times = _time_algorithms(rank, addrs, cfg)
        if rank == 0:
            results.put(json.dumps(times))


def _time_algorithms(rank: int, addrs: list[str], cfg: ShapedConfig) -> dict[str, list[float]]:
    """Sets up gloo and the Chaos communicators on this member's address and times them."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    n = len(addrs)
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    store = dist.TCPStore(addrs[0], STORE_PORT, n, rank == 0, timeout=timeout)
    # the options carry the device bound to this member's address (the default device would
    # resolve the hostname, which is not an address of the namespace)
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=addrs[rank])]
    opts._timeout = timeout
    pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, n, opts)
    comms = {
        algo: Communicator(CommunicatorConfig(
            node_id=f"r{rank}", listen=f"tcp://{addrs[rank]}:*", chunk_bytes=cfg.chunk_bytes,
            timeout_s=cfg.timeout_s))
        for algo in _algos(n, cfg) if algo != "gloo"
    }  # fmt: skip
    try:
        for algo, comm in comms.items():
            store.set(f"chaos-{algo}-{rank}", comm.address)
        book = {a: {f"r{i}": store.get(f"chaos-{a}-{i}").decode() for i in range(n)}
                for a in comms}  # fmt: skip
        for algo, topo in _topologies(n, book).items():
            comms[algo].update_topology(topo)
        return _repetitions(rank, pg, comms, cfg)
    finally:
        for comm in comms.values():
            comm.close()


def _algos(n: int, cfg: ShapedConfig) -> tuple[str, ...]:
    """The algorithms a case of ``n`` members times."""
    return SHAPED_ALGOS if n == 2 or cfg.deep_tree else ("ring", "gloo")


def _repetitions(
    rank: int, pg: Any, comms: dict[str, Communicator], cfg: ShapedConfig
) -> dict[str, list[float]]:
    """The timed repetitions: every algorithm after a barrier, the slowest member's time."""
    import torch.distributed as dist

    x = torch.randn(cfg.size // 4, generator=torch.Generator().manual_seed(rank))
    y = torch.empty_like(x)
    o = torch.empty_like(x)
    algos = _algos(pg.size(), cfg)
    times: dict[str, list[float]] = {a: [] for a in algos}
    _max: Any = dist.AllreduceOptions()
    _max.reduceOp = dist.ReduceOp.MAX
    for rep in range(cfg.repeats + 1):  # the first repetition warms up and is discarded
        for algo in algos:
            y.copy_(x)
            pg.barrier().wait()
            t0 = time.perf_counter()
            if algo == "gloo":
                pg.allreduce([y]).wait()
            else:
                comms[algo].allreduce(x, "sum", out=o)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            pg.allreduce([dt], _max).wait()
            if rep:
                times[algo].append(float(dt.item()))
    return times
