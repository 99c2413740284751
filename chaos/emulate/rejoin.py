"""``chaos-emulate compare --rejoin``: what a content-addressed join pulls, returning or fresh.

One cluster per strategy and repeat: ``nodes`` devices start, then device ``n<nodes>`` joins
fresh, trains, leaves keeping its state (its model and optimizer state dicts, saved to its run
folder), stays away ``away_s`` seconds while the others train, and comes back with that state: it
loads it before joining, and its pull skips every chunk it still holds. For ``gpt2-lora`` (the
shared base on every device's disk) a second fresh device without the base joins last, for
comparison. Each join reports the bytes pulled, the bytes reused, the state's size and the
replication time (see docs/emulation-runs.md, *Content-addressed joins*).
"""

from __future__ import annotations

import statistics
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from chaos.emulate.fleet import EmulationError
from chaos.emulate.metrics import consistency, summarize
from chaos.emulate.runner import STOP_TIMEOUT_S, Runner
from chaos.emulate.scenario import Event, Scenario
from chaos.emulate.stand_in import StandInKind, kind_for

FRESH = "fresh"
RETURN = "return"
FRESH_NO_BASE = "fresh, no base"
JOIN_KINDS = (FRESH, RETURN, FRESH_NO_BASE)
"""The joins of a rejoin run, in order (``fresh, no base`` only for a LoRA model)."""
_METRICS = ("state_bytes", "pulled_bytes", "reused_bytes", "replication_s", "scale_out_s",
            "lower_bound_s")  # fmt: skip


class RejoinRunner(Runner):
    """A :class:`Runner` whose devices can leave with their state and come back with it."""

    def leave_keeping_state(self, name: str) -> Path:
        """Asks ``name`` to save its model and optimizer state, then leave gracefully.

        Returns:
            The file it saved (in its run folder).

        Raises:
            EmulationError: it did not leave in time or saved nothing.
        """
        rec = self._mark("leave", node=name, label=f"leave {name} (keeps its state)")
        d = self.devices[name]
        d.gone = "leave"
        flag = d.out.with_suffix(".leave")
        flag.write_text("keep")
        try:
            d.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise EmulationError(f"{name} did not leave within {STOP_TIMEOUT_S} s") from exc
        held = flag.with_suffix(".held.pt")
        if not held.exists():
            raise EmulationError(f"{name} left without saving its state to {held}")
        rec.update(done_t=time.time(), held=str(held))
        self.progress(f"leave        {name}, keeping its state ({held.stat().st_size} bytes)")
        return held

    def join_with(self, name: str, label: str, device_args: list[str]) -> dict[str, Any]:
        """Starts ``name`` with more device arguments and waits until it is ready.

        A device that ran before (its links stay when it leaves) joins through its running
        neighbours; a new one links to ``degree`` random running devices, as a join does.

        Returns:
            The harness's join event.

        Raises:
            EmulationError: the device did not start.
        """
        rec = self._mark("join", node=name, label=label)
        live = set(self.running())
        nbrs = sorted({b if a == name else a for a, b in self._net.links() if name in (a, b)}
                      & live)  # fmt: skip
        if not nbrs:
            nbrs = sorted(self.join_rng.sample(sorted(live), min(self.sc.degree, len(live))))
            for n in nbrs:
                self._net.add_link(name, n, self._rate(name, n))
        rec["neighbors"] = nbrs
        self.device_args[name] = device_args
        try:
            self._start_device(name, nbrs)
        finally:
            del self.device_args[name]
        rec["ready_t"] = self._wait_ready(name)["t"]
        self.progress(f"join         {label}")
        return rec


def rejoin_runs(
    strategy: str, nodes: int, base: Scenario, out: Path, shaped: bool, repeat: int,
    away_s: float, progress: Any,
) -> list[dict[str, Any]]:  # fmt: skip
    """One rejoin run (see the module docstring); one row per join.

    Args:
        strategy: The daemons' replication strategy.
        nodes: Devices that form the cluster; ``n<nodes>`` is the one that leaves and returns.
        base: The scenario's model, scale, bandwidths and settle time.
        out: The run's folder.
        shaped: Namespaces and tc (``False``: loopback).
        repeat: The repeat's index (added to the seed).
        away_s: Seconds the device stays away.
        progress: Called with a line of text per notable happening.

    Returns:
        Per join: its kind, node, state, pulled and reused bytes, replication and scale-out
        seconds, lower bound, and the run's ``consistency`` (members bitwise equal).

    Raises:
        EmulationError: a device failed.
    """
    lora = kind_for(base.model) is StandInKind.LORA
    back, extra = f"n{nodes}", f"n{nodes + 1}"
    joins = [Event(at_s=0.0, kind="join", node=back)]
    joins += [Event(at_s=1.0, kind="join", node=extra)] if lora else []
    sc = replace(base, nodes=nodes, strategy=strategy, events=tuple(joins),
                 seed=base.seed + repeat)  # fmt: skip
    labels = {f"join {back}": FRESH, f"return {back}": RETURN,
              f"join {extra} (no base on disk)": FRESH_NO_BASE}  # fmt: skip
    with RejoinRunner(sc, out, shaped=shaped, progress=progress) as runner:
        runner.start_cluster()
        runner.watch(base.settle_s)
        runner.join_with(back, f"join {back}", [])
        runner.watch(base.settle_s)
        held = runner.leave_keeping_state(back)
        runner.watch(away_s)
        runner.join_with(back, f"return {back}", ["--load-held", str(held)])
        if lora:
            runner.watch(base.settle_s)
            runner.join_with(extra, f"join {extra} (no base on disk)", ["--no-base-on-disk"])
        runner.watch(base.settle_s)
    rows = []
    agree = consistency(runner.result)  # the members stayed bitwise equal (drift included)
    for r in summarize(runner.result):
        if r["kind"] != "join" or r["event"] not in labels:
            continue
        rows.append({"strategy": strategy, "model": base.model, "join": labels[r["event"]],
                     "node": r["node"], "away_s": away_s if labels[r["event"]] == RETURN else None,
                     **{m: r.get(m) for m in _METRICS}, "idle_s": r.get("idle_s"),
                     "repeat": repeat, "network": runner.result.network,
                     "consistency": agree})  # fmt: skip
    return rows


def _median(xs: list[Any]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def rejoin_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Medians over repeats per strategy and join kind, and the share of the state pulled."""
    out: dict[str, dict[str, Any]] = {}
    for strategy in sorted({r["strategy"] for r in rows}):
        for kind in JOIN_KINDS:
            rs = [r for r in rows if r["strategy"] == strategy and r["join"] == kind]
            if not rs:
                continue
            med = {m: _median([r[m] for r in rs]) for m in _METRICS}
            state, pulled = med["state_bytes"], med["pulled_bytes"]
            med["pulled_share"] = pulled / state if state and pulled is not None else None
            med["repeats"] = len(rs)
            out.setdefault(strategy, {})[kind] = med
    return out


def _mb(v: float | None) -> str:
    return "-" if v is None else f"{v / 1e6:.3f} MB"


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f} s"


def print_rejoin_table(summary: dict[str, dict[str, Any]], model: str) -> None:
    """Per join kind: the state, the bytes pulled and reused, the replication and scale-out
    delays (medians over repeats)."""
    click.echo(f"{'model':<12}{'join':<16}{'state':>13}{'pulled':>13}{'pulled %':>10}"
               f"{'reused':>13}{'replication':>13}{'scale-out':>12}")  # fmt: skip
    for strategy, per in summary.items():
        if len(summary) > 1:
            click.echo(f"[{strategy}]")
        for kind, m in per.items():
            share = "-" if m["pulled_share"] is None else f"{100 * m['pulled_share']:.1f}%"
            click.echo(f"{model:<12}{kind:<16}{_mb(m['state_bytes']):>13}"
                       f"{_mb(m['pulled_bytes']):>13}{share:>10}{_mb(m['reused_bytes']):>13}"
                       f"{_s(m['replication_s']):>13}{_s(m['scale_out_s']):>12}")  # fmt: skip


__all__ = ["JOIN_KINDS", "RejoinRunner", "print_rejoin_table", "rejoin_runs", "rejoin_summary"]
