"""``chaos-emulate demo``, ``run`` and ``compare``: real clusters on the emulated network.

Every device is a real ``chaos-daemon`` plus a real training process in its own namespace
(:mod:`chaos.emulate.runner`). Progress goes to stderr, tables to stdout; JSON and PNG plots go
where the options say. Without root the commands refuse, unless ``--loopback`` asks for the
unshaped loopback mode, which every output then labels as such.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import click

from chaos.emulate.fleet import EmulationError, RunResult
from chaos.emulate.metrics import consistency, continuity, summarize
from chaos.emulate.runner import Runner
from chaos.emulate.scenario import Event, Scenario, demo_scenario, load_scenario
from chaos.errors import ChaosError, ConfigError
from chaos.progress import LiveProgress

COMPARE_STRATEGIES = ("stop-resume", "single-source", "multi-source", "chaos")
"""``compare``'s strategies when ``--strategies`` is not given."""
_DAEMON_STRATEGY = {"single-source": "single-source", "multi-source": "multi-source",
                    "chaos": "chaos", "even": "even", "stop-resume": "chaos"}  # fmt: skip
STRATEGY_CHOICES = tuple(_DAEMON_STRATEGY)
"""Every strategy ``compare --strategies`` accepts: the defaults and ``even`` (an equal shard
split over the joiner's neighbours, the daemon's ``--replication-strategy even``)."""


def _progress_printer(desc: str = "run", total: float | None = None,
                      unit: str = "s") -> LiveProgress:  # fmt: skip
    """The live line of a run (a bar on a terminal), with its notes above it."""
    return LiveProgress(desc, total, unit)


def _shaped(loopback: bool) -> bool:
    if loopback:
        click.echo("note: loopback mode: no namespaces, no shaping; results are labelled "
                   "'loopback (unshaped)'", err=True)  # fmt: skip
        return False
    if os.geteuid() != 0:
        click.echo("error: the emulated network needs root (network namespaces and tc); run as "
                   "root, or pass --loopback for the unshaped loopback mode", err=True)  # fmt: skip
        sys.exit(2)
    return True


def _fmt(v: Any, unit: str = "s") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v * 1000:.1f} ms" if unit == "ms" else f"{v:.3f} {unit}"
    return str(v)


def print_event_table(rows: list[dict[str, Any]]) -> None:
    """The summary table of a run's events and their delays."""
    click.echo(f"{'event':<24}{'delay':>14}{'replication':>14}{'lower bound':>14}"
               f"{'idle (sum)':>12}{'control':>12}")  # fmt: skip
    for r in rows:
        delay = r.get("scale_out_s", r.get("detection_s", r.get("stall_s")))
        unit = "ms" if "stall_s" in r else "s"
        click.echo(f"{r['event']:<24}{_fmt(delay, unit):>14}{_fmt(r.get('replication_s')):>14}"
                   f"{_fmt(r.get('lower_bound_s')):>14}{_fmt(r.get('idle_s')):>12}"
                   f"{_fmt(r.get('control_s'), 'ms'):>12}")  # fmt: skip
    click.echo("delay: scale-out (join), failure detection (kill), or the stall added to the "
               "training step (leave, link events); see docs/emulation.md")  # fmt: skip


def result_doc(result: RunResult, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON document of a run: every event and metric."""
    sc = asdict(result.scenario)
    return {
        "scenario": sc,
        "network": result.network,
        "note": "devices replicate a state of the model's size; only a small head trains",
        "metrics": rows,
        "consistency": consistency(result),
        "continuity": continuity(result),
        "harness_events": result.harness_events,
        "daemon_events": result.daemon_events,
        "devices": result.devices,
        "link_rates_bps": result.link_rates,
        "cpu_per_device": result.scenario.cpu_per_device or None,
        "cpu_throttled_s": result.cpu_throttled_s,
    }


def print_continuity(result: RunResult) -> None:
    """Whether training went on after the last fault, each device that stopped or paused (and
    for how long), and the members' bitwise agreement."""
    cont = continuity(result)
    click.echo(f"training continued after the last fault: "
               f"{'yes' if cont['training_continued'] else 'NO'}")  # fmt: skip
    for node, gaps in sorted(cont["outages"].items()):
        spans = ", ".join(f"{g['kind']} {g['s']:.1f} s at +{g['from'] - result.started:.0f} s"
                          for g in gaps)  # fmt: skip
        click.echo(f"  {node}: {spans}")
    if not cont["outages"]:
        click.echo("  no device stopped or paused")
    click.echo(f"members bitwise equal: {consistency(result)}  network: {result.network}")


def _write(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    click.echo(f"wrote {path}", err=True)


def _run_scenario(sc: Scenario, out: Path, shaped: bool) -> tuple[RunResult, list[dict[str, Any]]]:
    try:
        with _progress_printer() as live, Runner(sc, out / "run", shaped=shaped,
                                                 progress=live) as runner:  # fmt: skip
            runner.run()
        result = runner.result
    except (EmulationError, ChaosError, OSError) as exc:
        raise click.ClickException(f"the run failed: {exc}") from exc
    return result, summarize(result)


@click.command("demo")
@click.option("--nodes", type=click.IntRange(4, 12), default=6, show_default=True)
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("out/demo"), show_default=True)  # fmt: skip
@click.option("--model", default="synthetic:64", show_default=True)
@click.option("--scale", type=float, default=0.05, show_default=True,
              help="Shrinks bandwidths and the state together.")  # fmt: skip
@click.option("--loopback", is_flag=True, help="Unshaped loopback mode (no root needed).")
def demo_command(nodes: int, out_dir: Path, model: str, scale: float, loopback: bool) -> None:
    """A small cluster through a join, a leave, a kill -9, a link add, a link cut, a partition
    and a heal (victims drawn among every device and link, cut vertices and bridges included)."""
    shaped = _shaped(loopback)
    try:
        sc = demo_scenario(nodes, scale, model)
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from exc
    result, rows = _run_scenario(sc, out_dir, shaped)
    print_event_table(rows)
    print_continuity(result)
    _write(out_dir / "demo.json", result_doc(result, rows))
    from chaos.emulate.plots import plot_timeline

    plot_timeline(result, out_dir / "demo.png")
    click.echo(f"wrote {out_dir / 'demo.png'}", err=True)


@click.command("run")
@click.argument("scenario_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              required=True)  # fmt: skip
@click.option("--loopback", is_flag=True, help="Unshaped loopback mode (no root needed).")
def run_command(scenario_file: Path, json_path: Path, loopback: bool) -> None:
    """Runs a scenario TOML file; records every event and metric to --json."""
    try:
        sc = load_scenario(scenario_file)
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="SCENARIO_FILE") from exc
    shaped = _shaped(loopback)
    result, rows = _run_scenario(sc, json_path.parent / f"{json_path.stem}-run", shaped)
    print_event_table(rows)
    print_continuity(result)
    _write(json_path, result_doc(result, rows))


def _parse_sizes(text: str) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition("-")
        a, b = int(lo), int(hi or lo)
    except ValueError as exc:
        raise click.BadParameter(f"{text!r}: expected N-M, e.g. 6-12") from exc
    if not 2 <= a < b <= 16:
        raise click.BadParameter(f"{text!r}: need 2 <= N < M <= 16")
    return a, b


def compare_runs(
    strategy: str, lo: int, hi: int, base: Scenario, out: Path, shaped: bool, repeat: int
) -> list[dict[str, Any]]:
    """Grows one cluster from ``lo`` to ``hi`` nodes under ``strategy``; one row per join."""
    joins = tuple(Event(at_s=float(i), kind="join", node=f"n{size}")
                  for i, size in enumerate(range(lo, hi)))  # fmt: skip
    # the joins are listed so that the network has a namespace for every device; they are
    # applied one by one below, each after the previous joiner is ready and has trained
    sc = replace(base, nodes=lo, strategy=_DAEMON_STRATEGY[strategy], events=joins,
                 seed=base.seed + repeat)  # fmt: skip
    rows = []
    with _progress_printer(f"{strategy} {lo}->{hi}", hi - lo, "joins") as live, \
            Runner(sc, out, shaped=shaped, progress=live) as runner:
        runner.start_cluster()
        for size in range(lo, hi):
            runner.watch(base.settle_s)
            live.at(size - lo, f"joining n{size}")
            name = f"n{size}"
            if strategy == "stop-resume":
                rec = runner.stop_resume_join(name)
                rows.append({"from_nodes": size, "to_nodes": size + 1, **rec})
            else:
                runner.apply(Event(at_s=0.0, kind="join", node=name))
                rows.append({"from_nodes": size, "to_nodes": size + 1, "node": name})
                if strategy == "chaos":  # Fig. 9: connect-link as the cluster grows
                    runner.watch(base.settle_s)
                    runner.apply(Event(at_s=0.0, kind="link_add"))
        if strategy != "stop-resume":  # the last joiner may still replay (catch-up)
            runner.wait_entered(f"n{hi - 1}")
        live.at(hi - lo, "settling")
        runner.watch(base.settle_s)
    links: list[dict[str, Any]] = []
    if strategy != "stop-resume":
        summary = summarize(runner.result)
        measured = {r["node"]: r for r in summary if r["kind"] == "join"}
        rows = [{**r, **measured.get(r["node"], {})} for r in rows]
        nodes = lo
        for r in summary:
            nodes += r["kind"] == "join"
            if r["kind"] == "link_add":
                links.append({"strategy": strategy, "kind": "connect_link", "nodes": nodes,
                              "link": r["event"], "control_s": r.get("control_s"),
                              "stall_s": r.get("stall_s"), "repeat": repeat})  # fmt: skip
    out_rows = []
    for r in rows:
        out_rows.append({
            "strategy": strategy, "from_nodes": r["from_nodes"], "to_nodes": r["to_nodes"],
            "model": base.model, "state_bytes": r.get("state_bytes"),
            "scale_out_s": r.get("scale_out_s"), "replication_s": r.get("replication_s"),
            "lower_bound_s": r.get("lower_bound_s"), "idle_s": r.get("idle_s"),
            "non_donor_rate_min": r.get("non_donor_rate_min"),
            "pulled_bytes": r.get("pulled_bytes"), "reused_bytes": r.get("reused_bytes"),
            "repeat": repeat, "donors": r.get("donors"), "network": runner.result.network,
            **({"checkpoint_store": r.get("checkpoint_store"), "checkpoint_fetch_s": r["fetch_s"]}
               if "fetch_s" in r else {}),
        })  # fmt: skip
    return out_rows + links


@click.command("compare")
@click.option("--sizes", default="6-12", show_default=True, help="Grow from N to M nodes.")
@click.option("--model", default="resnet101", show_default=True)
@click.option("--strategies", default=None,
              help=f"Comma-separated, from {','.join(STRATEGY_CHOICES)}. Default: "
              f"{','.join(COMPARE_STRATEGIES)}; with --rejoin: chaos.")  # fmt: skip
@click.option("--rejoin", is_flag=True,
              help="Instead of growing: N devices, then n<N> joins fresh, leaves with its "
              "state and returns --away seconds later (gpt2-lora: then a fresh device without "
              "the base joins); reports the bytes each join pulled and reused.")  # fmt: skip
@click.option("--away", "away_s", type=click.FloatRange(0.0, 3600.0), default=30.0,
              show_default=True, help="--rejoin: seconds the device stays away.")  # fmt: skip
@click.option("--bandwidth", default="100-1000", show_default=True, help="Mbit/s range.")
@click.option("--scale", type=float, default=0.02, show_default=True)
@click.option("--repeats", type=click.IntRange(1, 20), default=1, show_default=True)
@click.option("--first-repeat", type=click.IntRange(0, 100), default=0, show_default=True,
              help="Index of the first repeat (its seed): rerun repeat K alone with "
                   "--first-repeat K --repeats 1.")  # fmt: skip
@click.option("--settle", type=float, default=2.0, show_default=True,
              help="Seconds of training between joins.")  # fmt: skip
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              required=True)  # fmt: skip
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--loopback", is_flag=True, help="Unshaped loopback mode (no root needed).")
@click.option("--cpu-per-device", "cpu_per_device", type=click.FloatRange(0.0, 1024.0),
              default=0.0, show_default=True,
              help="Each device's own CPU budget in cores (a cgroup each; needs root), so that "
                   "one device's work (a joiner's) takes no CPU from the others, as on separate "
                   "machines; 0: every device shares every core.")  # fmt: skip
def compare_command(sizes: str, model: str, strategies: str | None, rejoin: bool, away_s: float,
                    bandwidth: str, scale: float, repeats: int, first_repeat: int, settle: float,
                    json_path: Path, plot_dir: Path | None, loopback: bool,
                    cpu_per_device: float) -> None:  # fmt: skip
    """Scale-out under each strategy as the cluster grows (the paper's Figs. 7, 10 and 15);
    with --rejoin, what content-addressed joins pull: a returning device and fresh ones."""
    lo, hi = _parse_sizes(sizes)
    chosen = parse_strategies(strategies, rejoin)
    low, _, high = bandwidth.partition("-")
    try:
        base = Scenario(name="compare", nodes=lo, model=model, scale=scale, settle_s=settle,
                        bandwidth_mbps=(float(low), float(high or low)),
                        cpu_per_device=cpu_per_device)  # fmt: skip
    except (ConfigError, ValueError) as exc:
        raise click.BadParameter(str(exc)) from exc
    shaped = _shaped(loopback)
    if rejoin:
        _compare_rejoin(chosen, lo, base, json_path, shaped, repeats, away_s)
        return
    _compare_grow(chosen, lo, hi, base, json_path, shaped, range(first_repeat,
                  first_repeat + repeats), plot_dir)  # fmt: skip


def _compare_grow(strategies: list[str], lo: int, hi: int, base: Scenario, json_path: Path,
                  shaped: bool, repeats: range, plot_dir: Path | None) -> None:  # fmt: skip
    """``compare`` without ``--rejoin``: every strategy's growth per repeat, the table, JSON and
    plots. A run that fails is recorded under ``failed`` (strategy, repeat, error; the joins it
    had measured are lost) and the others go on; the command then exits with an error."""
    runs: list[dict[str, Any]] = []
    links: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    doc: dict[str, Any] = {"scale": base.scale, "sizes": [lo, hi],
                           "cpu_per_device": base.cpu_per_device or None}  # fmt: skip
    for rep in repeats:
        for strategy in strategies:
            click.echo(f"== {strategy}, repeat {rep + 1}/{repeats.stop}", err=True)
            out = json_path.parent / f"{json_path.stem}-runs" / f"{strategy}-{rep}"
            try:
                got = compare_runs(strategy, lo, hi, base, out, shaped, rep)
            except (EmulationError, ChaosError, OSError) as exc:
                click.echo(f"error: {strategy} run (repeat {rep + 1}) failed: {exc}", err=True)
                failed.append({"strategy": strategy, "repeat": rep, "error": str(exc)})
                got = []
            runs += [r for r in got if r.get("kind") != "connect_link"]
            links += [r for r in got if r.get("kind") == "connect_link"]
            _write(json_path, {"runs": runs, "connect_link": links, "failed": failed, **doc})
    summary = compare_summary(runs)
    print_compare_table(summary)
    _print_connect_link(links)
    network = runs[0]["network"] if runs else None
    _write(json_path, {"runs": runs, "summary": summary, "connect_link": links, "failed": failed,
                       **doc, "network": network})  # fmt: skip
    if plot_dir is not None and runs:
        from chaos.emulate.plots import plot_compare

        for path in plot_compare(runs, plot_dir, links):
            click.echo(f"wrote {path}", err=True)
    if failed:
        raise click.ClickException(f"{len(failed)} run(s) failed: "
                                   + "; ".join(f"{f['strategy']} repeat {f['repeat'] + 1}"
                                               for f in failed))  # fmt: skip


def parse_strategies(text: str | None, rejoin: bool = False) -> list[str]:
    """``compare --strategies``: the strategies to run, in the order given.

    Args:
        text: The option's comma-separated value, or None for the default.
        rejoin: Whether ``--rejoin`` is given (default ``chaos``; stop-resume is refused).

    Returns:
        The chosen strategies, each one of :data:`STRATEGY_CHOICES`.

    Raises:
        click.BadParameter: If a name is unknown, none is given, or stop-resume with rejoin.
    """
    default = "chaos" if rejoin else ",".join(COMPARE_STRATEGIES)
    chosen = [s.strip() for s in (text or default).split(",") if s.strip()]
    bad = [s for s in chosen if s not in STRATEGY_CHOICES]
    if bad or not chosen:
        raise click.BadParameter(f"unknown strategies {bad}; pick from {list(STRATEGY_CHOICES)}",
                                 param_hint="--strategies")  # fmt: skip
    if rejoin and "stop-resume" in chosen:
        raise click.BadParameter("--rejoin measures replication: stop-resume has none")
    return chosen


@click.command("compare-plot")
@click.argument("json_files", nargs=-1, required=True,
                type=click.Path(exists=True, dir_okay=False, path_type=Path))  # fmt: skip
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              required=True, help="Folder for the PNGs.")  # fmt: skip
@click.option("--name", default="compare_models.png", show_default=True,
              help="Several files: the PNG of the scale-out delay per model.")  # fmt: skip
def compare_plot_command(json_files: tuple[Path, ...], out_dir: Path, name: str) -> None:
    """Plots ``compare --json`` documents again. One file: compare's plots (the scale-out
    delay, the replication delay per strategy, chaos's lower bound, connect-link). Several
    files, one model each: the chaos scale-out delay per model and cluster size (Fig. 8)."""
    from chaos.emulate.plots import plot_compare, plot_models

    try:
        docs = [json.loads(p.read_text()) for p in json_files]
    except (OSError, ValueError) as exc:
        raise click.BadParameter(str(exc), param_hint="JSON_FILES") from exc
    if any("runs" not in d for d in docs):
        raise click.BadParameter("not a compare --json document (no 'runs')")
    if len(docs) == 1:
        paths = plot_compare(docs[0]["runs"], out_dir, docs[0].get("connect_link"))
    else:
        paths = [plot_models(docs, out_dir / name)]
    for path in paths:
        click.echo(f"wrote {path}", err=True)


def _compare_rejoin(strategies: list[str], nodes: int, base: Scenario, json_path: Path,
                    shaped: bool, repeats: int, away_s: float) -> None:  # fmt: skip
    """``compare --rejoin``: the rejoin runs, their table and JSON."""
    from chaos.emulate.rejoin import print_rejoin_table, rejoin_runs, rejoin_summary

    rows: list[dict[str, Any]] = []
    doc: dict[str, Any] = {"mode": "rejoin", "model": base.model, "scale": base.scale,
                           "nodes": nodes, "away_s": away_s}  # fmt: skip
    for rep in range(repeats):
        for strategy in strategies:
            click.echo(f"== rejoin, {strategy}, repeat {rep + 1}/{repeats}", err=True)
            out = json_path.parent / f"{json_path.stem}-runs" / f"rejoin-{strategy}-{rep}"
            try:
                with _progress_printer(f"rejoin {strategy}") as live:
                    rows += rejoin_runs(_DAEMON_STRATEGY[strategy], nodes, base, out, shaped,
                                        rep, away_s, live)  # fmt: skip
            except (EmulationError, ChaosError, OSError) as exc:
                raise click.ClickException(f"rejoin run ({strategy}) failed: {exc}") from exc
            _write(json_path, {**doc, "joins": rows})
    summary = rejoin_summary(rows)
    print_rejoin_table(summary, base.model)
    network = rows[0]["network"] if rows else None
    _write(json_path, {**doc, "joins": rows, "summary": summary, "network": network})


def _print_connect_link(links: list[dict[str, Any]]) -> None:
    if not links:
        return
    click.echo(f"{'connect-link':<16}" + "".join(f"{r['nodes']:>10}" for r in links))
    click.echo(f"{'  control':<16}" + "".join(f"{_fmt(r['control_s'], ''):>10}" for r in links))
    click.echo(f"{'  step stall':<16}" + "".join(f"{_fmt(r['stall_s'], ''):>10}" for r in links))


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


_Medians = dict[str, dict[str, float | None]]


def _ratios(other: _Medians, chaos: _Medians, metric: str) -> dict[str, float]:
    """Per size, ``other``'s median ``metric`` over chaos's (sizes where chaos has one)."""
    out = {}
    for k, v in chaos.items():
        base = v[metric]
        if base and k in other:
            out[k] = (other[k][metric] or 0) / base
    return out


def compare_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeats per strategy and size, and the headline ratios of the results."""
    table: dict[str, dict[str, dict[str, float | None]]] = {}
    for r in runs:
        key = f"{r['from_nodes']}->{r['to_nodes']}"
        table.setdefault(r["strategy"], {}).setdefault(key, {})
    for strategy, per in table.items():
        for key in per:
            rs = [r for r in runs
                  if r["strategy"] == strategy and f"{r['from_nodes']}->{r['to_nodes']}" == key]
            per[key] = {m: _median([r.get(m) for r in rs])
                        for m in ("scale_out_s", "replication_s", "lower_bound_s", "idle_s",
                                  "non_donor_rate_min")}  # fmt: skip
    out: dict[str, Any] = {"median": table}
    chaos = table.get("chaos", {})
    ratios: dict[str, Any] = {}
    for other in ("stop-resume", "single-source", "multi-source", "even"):
        if other in table:
            ratios[f"{other}/chaos"] = _ratios(table[other], chaos, "scale_out_s")
    ratios["replication"] = {f"{other}/chaos": _ratios(table[other], chaos, "replication_s")
                             for other in ("single-source", "multi-source", "even")
                             if other in table}  # fmt: skip
    over = [v["replication_s"] / v["lower_bound_s"] for v in chaos.values()
            if v["replication_s"] and v["lower_bound_s"]]  # fmt: skip
    # the median over sizes of chaos's median replication delay / its lower bound (1.0: on it)
    ratios["chaos_replication_over_lower_bound_median"] = (
        statistics.median(over) if over else None)
    out["ratios"] = ratios
    return out


def print_compare_table(summary: dict[str, Any]) -> None:
    """Scale-out delay per strategy and size (medians over repeats)."""
    table = summary["median"]
    keys = sorted({k for per in table.values() for k in per}, key=lambda k: int(k.split("-")[0]))
    click.echo(f"{'scale-out (s)':<16}" + "".join(f"{k:>10}" for k in keys))
    for strategy, per in table.items():
        cells = "".join(f"{_fmt(per.get(k, {}).get('scale_out_s'), ''):>10}" for k in keys)
        click.echo(f"{strategy:<16}{cells}")
    click.echo(f"{'replication (s)':<16}")
    for strategy, per in table.items():
        if strategy != "stop-resume":
            click.echo(f"{'  ' + strategy:<16}" + "".join(
                f"{_fmt(per.get(k, {}).get('replication_s'), ''):>10}" for k in keys))
    if "chaos" in table:
        click.echo(f"{'lower bound':<16}" + "".join(
            f"{_fmt(table['chaos'].get(k, {}).get('lower_bound_s'), ''):>10}" for k in keys))
        # the slowest non-donor's step rate during the join over its steady rate (1.0: unslowed)
        click.echo(f"{'non-donor rate':<16}" + "".join(
            f"{_fmt(table['chaos'].get(k, {}).get('non_donor_rate_min'), ''):>10}" for k in keys))
    click.echo(json.dumps(summary["ratios"], indent=1))


def _parse_weights(text: str | None) -> dict[str, float]:
    from chaos.emulate.campaign import DEFAULT_WEIGHTS

    if not text:
        return dict(DEFAULT_WEIGHTS)
    out = dict.fromkeys(DEFAULT_WEIGHTS, 0.0)
    for part in text.split(","):
        kind, _, w = part.partition("=")
        if kind.strip() not in out:
            raise click.BadParameter(f"{kind!r}: kinds are {', '.join(DEFAULT_WEIGHTS)}")
        try:
            out[kind.strip()] = float(w)
        except ValueError as exc:
            raise click.BadParameter(f"{part!r}: expected KIND=WEIGHT") from exc
    return out


@click.command("chaos")
@click.option("--nodes", type=click.IntRange(2, 32), default=6, show_default=True,
              help="Devices at the start; joiners refill the cluster to this size.")  # fmt: skip
@click.option("--duration", type=click.FloatRange(1.0, 7 * 86400.0), default=600.0,
              show_default=True, help="Seconds of fault injection.")  # fmt: skip
@click.option("--rate", type=click.FloatRange(0.01, 600.0), default=6.0, show_default=True,
              help="Faults per minute (Poisson); replacement joins come on top.")  # fmt: skip
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              required=True)  # fmt: skip
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--loopback", is_flag=True, help="Unshaped loopback mode (no root needed).")
@click.option("--min-live", type=click.IntRange(2, 32), default=None,
              help="Never fewer running devices (default: max(2, nodes // 2)).")  # fmt: skip
@click.option("--max-live", type=click.IntRange(0, 64), default=0,
              help="Never more running devices (0: twice --nodes).")  # fmt: skip
@click.option("--weights", default=None,
              help="KIND=W,... relative frequency of leave, kill, link_cut, partition, heal.")
@click.option("--cut-vertex-bias", type=click.FloatRange(0.0, 1.0), default=0.5,
              show_default=True,
              help="Probability that a kill aims at a cut vertex of the overlay, if any.")
@click.option("--degree", type=click.IntRange(1, 8), default=2, show_default=True,
              help="Overlay links per device and per joiner (1: a tree, all cut vertices).")
@click.option("--model", default="synthetic:8", show_default=True)
@click.option("--scale", type=float, default=0.05, show_default=True)
@click.option("--step-timeout", "step_timeout_s", type=click.FloatRange(1.0, 3600.0),
              default=15.0, show_default=True,
              help="Every trainer's step_timeout_s: how long a round in which every member "
              "waits holds the cluster before it reruns (keep it above the daemons' 10 s "
              "straggler grace).")  # fmt: skip
@click.option("--sample", "sample_s", type=click.FloatRange(0.5, 600.0), default=5.0,
              show_default=True, help="Seconds between RSS / open-file samples.")  # fmt: skip
@click.option("--warmup", "warmup_s", type=click.FloatRange(0.0, 3600.0), default=20.0,
              show_default=True, help="A device's samples this soon after ready are not the "
              "baseline.")  # fmt: skip
@click.option("--keep-majority/--no-keep-majority", default=True, show_default=True,
              help="Skip a kill or leave that would leave fewer than a strict majority of the "
              "committed membership running (past it the cluster pauses for good).")
@click.option("--inner-steps", type=click.IntRange(0, 100_000), default=0, show_default=True,
              help="Local-steps mode: every device takes an outer step every this many inner "
              "steps (0: synchronise every step); steps in the report are outer steps.")
@click.option("--overlap", is_flag=True,
              help="With --inner-steps: the outer step runs beside the next inner phase.")
def chaos_command(nodes: int, duration: float, rate: float, seed: int, json_path: Path,
                  plot_dir: Path | None, loopback: bool, min_live: int | None, max_live: int,
                  weights: str | None, cut_vertex_bias: float, degree: int, model: str,
                  scale: float, step_timeout_s: float, sample_s: float, warmup_s: float,
                  keep_majority: bool, inner_steps: int, overlap: bool) -> None:  # fmt: skip
    """A fault campaign and soak: Poisson-timed joins, leaves, kill -9s, link cuts,
    partitions and heals on a training cluster; reports per fault kind whether and how fast
    training resumed, lost or divergent steps, crashes, ETTR, and RSS/open files over time."""
    from chaos.emulate.campaign import Campaign, CampaignConfig, format_table

    try:
        cfg = CampaignConfig(nodes=nodes, duration_s=duration, rate_per_min=rate, seed=seed,
                             min_live=min_live if min_live is not None else max(2, nodes // 2),
                             max_live=max_live, weights=_parse_weights(weights),
                             cut_vertex_bias=cut_vertex_bias, degree=degree, model=model,
                             scale=scale, step_timeout_s=step_timeout_s, sample_s=sample_s,
                             warmup_s=warmup_s, keep_majority=keep_majority,
                             inner_steps=inner_steps, overlap=overlap)  # fmt: skip
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from exc
    shaped = _shaped(loopback)
    camp = Campaign(cfg, json_path.parent / f"{json_path.stem}-run", shaped,
                    progress=(live := _progress_printer("campaign", duration)))  # fmt: skip
    n_faults = sum(1 for e in camp.plan if e.kind != "join")
    click.echo(f"plan: {len(camp.plan)} events ({n_faults} faults) over {duration:.0f} s",
               err=True)  # fmt: skip
    try:
        doc = camp.run()
    except (EmulationError, ChaosError, OSError) as exc:
        raise click.ClickException(f"the campaign failed: {exc}") from exc
    finally:
        live.close()
    click.echo(format_table(doc))
    _write(json_path, doc)
    if plot_dir is not None:
        from chaos.emulate.plots import plot_campaign

        path = plot_campaign(doc, plot_dir / "chaos_timeline.png")
        click.echo(f"wrote {path}", err=True)


@click.command("chaos-report")
@click.argument("run_json", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Also write the report, its figures recomputed, here.")  # fmt: skip
def chaos_report_command(run_json: Path, json_path: Path | None) -> None:
    """Prints the report of a ``chaos`` run's JSON again, its fault figures (when each fault
    resumed, single faults), integrity figures and RSS and open-file figures recomputed from
    the stored events and samples by this version's definitions (a run made before a figure
    existed, or before a definition changed, gains the new one)."""
    from chaos.emulate.campaign import format_table
    from chaos.emulate.campaign_report import recompute

    try:
        doc = recompute(json.loads(run_json.read_text()))
        table = format_table(doc)
    except (ValueError, KeyError, TypeError) as exc:
        raise click.ClickException(f"{run_json} is not a chaos run's JSON: {exc!r}") from exc
    click.echo(table)
    if json_path is not None:
        _write(json_path, doc)
