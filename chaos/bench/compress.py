"""``chaos-bench compress``: what each wire format costs on the wire and in accuracy.

``N`` spawned members on loopback each hold one :class:`~chaos.collectives.Communicator`. For
every wire format (float32, bfloat16, int8 with error feedback, int8 without) and both
algorithms (ring, tree), they run the same ``R`` mean allreduces of the same float32 tensors
(standard normal, a different scale per member). Per row:

* ``bytes_per_element``: the data-frame bytes (headers and payloads) every member sent in
  one round, from :attr:`CollectiveStats.data_bytes_sent
  <chaos.collectives.config.CollectiveStats.data_bytes_sent>`, over the tensor's elements,
  averaged over members and rounds; ``vs_float32`` divides it by the float32 row's;
* ``rel_rms_error`` and ``max_error``: the first round's result against the exact mean
  (float64), as RMS over the mean's RMS and as the largest error over the mean's largest
  magnitude;
* ``drift``: the largest error of the sum of the ``R`` results against the sum of the exact
  means, over the mean's largest magnitude (error feedback keeps it from growing with ``R``);
* ``bitwise_equal``: every member got the same bytes in every round;
* ``round_s``: the median round time on loopback (the CPUs of this machine, not a link).

``codec`` gives one round trip of one member's tensor through bfloat16 and int8 (no
allreduce): its payload bytes per element and its relative errors.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import queue
import statistics
import time
from pathlib import Path
from typing import Any

import click
import numpy as np
import torch

from chaos.collectives import Communicator, CommunicatorConfig, ErrorFeedback, Topology
from chaos.collectives.compress import decode, encode, payload_bytes

__all__ = ["WIRES", "codec_errors", "compress_command", "run_bench"]

WIRES = ("float32", "bfloat16", "int8", "int8_no_feedback")
"""The rows' wire formats (``int8_no_feedback``: int8 without an error feedback)."""
KINDS = ("ring", "tree")
RESULT_TIMEOUT_S = 900.0


def member_input(rank: int, step: int, numel: int) -> torch.Tensor:
    """Member ``rank``'s tensor of round ``step`` (the same in every row)."""
    gen = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randn(numel, generator=gen) * (1.0 + 0.5 * rank)


def _topology(kind: str, names: list[str], addrs: dict[str, str], epoch: int) -> Topology:
    if kind == "ring":
        return Topology("ring", tuple(names), addrs, epoch, ring_order=tuple(names))
    parent = {m: (None if i == 0 else names[(i - 1) // 2]) for i, m in enumerate(names)}
    return Topology("tree", tuple(names), addrs, epoch, parent=parent)


def _worker(rank: int, n: int, numel: int, rounds: int, commands: Any, results: Any) -> None:
    """One member: runs every row's rounds and reports its bytes, times and result digests
    (member 0 also its results)."""
    torch.set_num_threads(1)
    names = [f"m{i}" for i in range(n)]
    comm = Communicator(CommunicatorConfig(names[rank], timeout_s=120.0))
    try:
        results.put(comm.address)
        addrs: dict[str, str] = commands.get(timeout=RESULT_TIMEOUT_S)
        rows, epoch, step = [], 0, 0
        for kind in KINDS:
            epoch += 1
            comm.update_topology(_topology(kind, names, addrs, epoch))
            for wire in WIRES:
                fb = ErrorFeedback() if wire == "int8" else None
                before = comm.stats.data_bytes_sent
                times, digests, first, total = [], [], None, np.zeros(numel)
                for r in range(rounds):
                    x = member_input(rank, r, numel)
                    started = time.perf_counter()
                    out = comm.allreduce(x, "mean", wire_dtype=wire.removesuffix("_no_feedback"),
                                         step=step, feedback=fb)  # fmt: skip
                    times.append(time.perf_counter() - started)
                    step += 1
                    digests.append(hashlib.sha256(out.numpy().tobytes()).hexdigest())
                    total += out.numpy()
                    if r == 0:
                        first = out.numpy().copy()
                sent = comm.stats.data_bytes_sent - before
                row = {"kind": kind, "wire": wire, "sent": sent, "times": times,
                       "digests": digests}  # fmt: skip
                if rank == 0:
                    row["first"], row["total"] = first, total
                rows.append(row)
        results.put(rows)
        # closing drops what is still queued to a member finishing its last round: close
        # only once the runner has every member's rows
        commands.get(timeout=RESULT_TIMEOUT_S)
    except Exception as exc:  # the runner reports it at once, not after its timeout
        results.put(f"member m{rank} failed: {exc!r}")
        raise
    finally:
        comm.close()


def _exact(n: int, numel: int, rounds: int) -> tuple[np.ndarray, np.ndarray]:
    """The exact mean of round 0 and the sum of the exact means of all rounds (float64)."""
    means = [np.mean([member_input(k, r, numel).double().numpy() for k in range(n)], axis=0)
             for r in range(rounds)]  # fmt: skip
    return means[0], np.sum(means, axis=0)


def run_bench(nodes: int, numel: int, rounds: int) -> dict[str, Any]:
    """Runs the benchmark and returns its JSON-ready figures (see the module docstring)."""
    ctx = mp.get_context("spawn")
    commands = [ctx.Queue() for _ in range(nodes)]
    replies = [ctx.Queue() for _ in range(nodes)]
    procs = [ctx.Process(target=_worker, args=(k, nodes, numel, rounds, commands[k], replies[k]),
                         daemon=True) for k in range(nodes)]  # fmt: skip
    try:
        for p in procs:
            p.start()
        addresses = [q.get(timeout=RESULT_TIMEOUT_S) for q in replies]
        addrs = {f"m{k}": a for k, a in enumerate(addresses)}
        for q in commands:
            q.put(addrs)
        got = [q.get(timeout=RESULT_TIMEOUT_S) for q in replies]
        failed = [g for g in got if isinstance(g, str)]
        if failed:
            raise click.ClickException("; ".join(failed))
        for q in commands:
            q.put("close")
    except queue.Empty:
        raise click.ClickException("a member sent no result in time") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    first_ref, total_ref = _exact(nodes, numel, rounds)
    return {"nodes": nodes, "numel": numel, "rounds": rounds, "codec": codec_errors(numel),
            "rows": _rows(got, first_ref, total_ref, numel, rounds)}  # fmt: skip


def codec_errors(numel: int) -> dict[str, dict[str, float]]:
    """One round trip through each format of one member's tensor: payload bytes per element
    and the relative RMS and largest error."""
    x = member_input(0, 0, numel)
    trips = {
        "bfloat16": (x.to(torch.bfloat16).float(), 2.0),
        "int8": (decode(encode(x), numel), payload_bytes(numel) / numel),
    }
    out = {}
    for name, (y, size) in trips.items():
        err = (y - x).double()
        rms = float(err.pow(2).mean().sqrt() / x.double().pow(2).mean().sqrt())
        peak = float(err.abs().max() / x.abs().max())
        out[name] = {"bytes_per_element": size, "rel_rms_error": rms, "max_error": peak}
    return out


def _rows(
    got: list[list[dict[str, Any]]],
    first_ref: np.ndarray,
    total_ref: np.ndarray,
    numel: int,
    rounds: int,
) -> list[dict[str, Any]]:
    """The table's rows from every member's reports."""
    rows, base = [], {}
    peak = float(np.abs(first_ref).max())
    rms = float(np.sqrt(np.mean(first_ref**2)))
    for j, lead in enumerate(got[0]):
        per_member = [member[j] for member in got]
        sent = statistics.mean(m["sent"] for m in per_member) / rounds / numel
        if lead["wire"] == "float32":
            base[lead["kind"]] = sent
        err = lead["first"] - first_ref
        rows.append({
            "kind": lead["kind"],
            "wire": lead["wire"],
            "bytes_per_element": round(sent, 4),
            "vs_float32": round(sent / base[lead["kind"]], 4),
            "rel_rms_error": float(np.sqrt(np.mean(err**2))) / rms,
            "max_error": float(np.abs(err).max()) / peak,
            "drift": float(np.abs(lead["total"] - total_ref).max()) / peak,
            "bitwise_equal": all(m["digests"] == lead["digests"] for m in per_member),
            "round_s": statistics.median(max(m["times"][r] for m in per_member)
                                         for r in range(rounds)),  # fmt: skip
        })  # fmt: skip
    return rows


@click.command("compress")
@click.option("--nodes", default=3, show_default=True, help="Members (spawned processes).")
@click.option("--numel", default=1 << 20, show_default=True, help="Float32 elements per tensor.")
@click.option("--rounds", default=5, show_default=True, help="Allreduces per row.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Also write the figures here.")  # fmt: skip
def compress_command(nodes: int, numel: int, rounds: int, json_path: Path | None) -> None:
    """Wire bytes and round-trip error of the float32, bfloat16 and int8 wire formats."""
    if nodes < 2 or numel < 1 or rounds < 1:
        raise click.BadParameter("needs --nodes >= 2, --numel >= 1 and --rounds >= 1")
    result = run_bench(nodes, numel, rounds)
    for name, c in result["codec"].items():
        click.echo(f"one round trip, {name}: {c['bytes_per_element']:.4f} B/elem, relative RMS "
                   f"error {c['rel_rms_error']:.2e}, largest {c['max_error']:.2e}")  # fmt: skip
    click.echo(f"{nodes} members, {numel} float32 elements, {rounds} mean allreduces per row")
    click.echo(f"{'kind':5} {'wire':17} {'B/elem':>7} {'vs f32':>7} {'rel rms':>9} "
               f"{'max err':>9} {'drift':>9} {'equal':>5} {'round s':>8}")  # fmt: skip
    for r in result["rows"]:
        click.echo(f"{r['kind']:5} {r['wire']:17} {r['bytes_per_element']:7.3f} "
                   f"{r['vs_float32']:7.3f} {r['rel_rms_error']:9.2e} {r['max_error']:9.2e} "
                   f"{r['drift']:9.2e} {r['bitwise_equal']!s:>5} "
                   f"{r['round_s']:8.3f}")  # fmt: skip
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
