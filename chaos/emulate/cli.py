"""``chaos-emulate``: the emulation harness's command line (needs root).

- ``chaos-emulate links``: builds a random overlay of shaped links, measures every link's
  bandwidth and latency against its setting, prints a table and writes JSON.
- ``chaos-emulate relay-bench``: measures the latency relay's delay accuracy and its ceiling.
- ``chaos-emulate cleanup``: removes namespaces left behind by crashed runs.
- ``chaos-emulate demo``, ``run``, ``compare`` and ``chaos`` (the fault campaign): real
  clusters, see :mod:`chaos.emulate.commands` (``compare --rejoin``: what content-addressed
  joins of a returning and of fresh devices pull, :mod:`chaos.emulate.rejoin`).
- ``chaos-emulate train``: time to a target loss with real training on shaped links,
  :mod:`chaos.emulate.train_bench_run`.

Progress goes to stderr, tables to stdout. Without root each command says so and exits with 2.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click

from chaos.emulate.measure import PingResult, bulk_transfer, ping
from chaos.emulate.netns import require_root
from chaos.emulate.network import (
    LinkSpec,
    Network,
    NetworkConfig,
    RootRequiredError,
    cleanup_stale,
)
from chaos.emulate.schedule import BandwidthSchedule, ScheduleConfig, random_overlay

MBIT = 1e6
RELAY_TOLERANCE = 0.10  # the relay's ceiling: delay within 10% of target ...
RELAY_MIN_DELIVERY = 0.90  # ... while delivering at least 90% of the offered rate
TCP_BUF_MAX = 64 << 20  # relay-bench: TCP buffers large enough that the window never limits


def _parse_range(text: str) -> tuple[float, float]:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:-\s*(\d+(?:\.\d+)?))?\s*", text)
    if not m:
        raise click.BadParameter(f"{text!r}: expected LOW-HIGH in Mbit/s, e.g. 100-1000")
    low = float(m.group(1))
    high = float(m.group(2)) if m.group(2) else low
    if low <= 0 or low > high:
        raise click.BadParameter(f"{text!r}: need 0 < LOW <= HIGH")
    return low * MBIT, high * MBIT


def _parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) * MBIT for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise click.BadParameter(f"{text!r}: expected comma-separated Mbit/s values") from e
    if not rates or any(r <= 0 for r in rates):
        raise click.BadParameter(f"{text!r}: need at least one positive rate")
    return sorted(rates)


@contextmanager
def _root_errors() -> Iterator[None]:
    try:
        require_root()
        yield
    except RootRequiredError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)


def _progress(msg: str) -> None:
    click.echo(msg, err=True)


def _write_json(path: Path | None, doc: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=2) + "\n")
        _progress(f"wrote {path}")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Chaos emulation harness: namespaces, shaped veth links, latency (needs root)."""


@main.command("links")
@click.option("--nodes", type=click.IntRange(2, 64), default=6, show_default=True,
              help="Devices in the random overlay.")
@click.option("--degree", type=click.IntRange(1, 8), default=2, show_default=True,
              help="Each new device links to this many earlier ones.")
@click.option("--bandwidth", "bandwidth", default="100-1000", show_default=True,
              help="Link rate range in Mbit/s (LOW-HIGH); each link draws from it.")
@click.option("--scale", type=click.FloatRange(min=1e-4, max=100.0), default=1.0,
              show_default=True, help="Factor applied to every drawn rate.")
@click.option("--latency-s", type=click.FloatRange(0.0, 1.0), default=0.0, show_default=True,
              help="One-way delay per link, seconds (netem or the TUN relay).")
@click.option("--latency-method", type=click.Choice(["auto", "netem", "relay"]), default="auto",
              show_default=True)
@click.option("--duration-s", type=click.FloatRange(0.2, 60.0), default=1.0, show_default=True,
              help="Measuring window of each link's bulk transfer.")
@click.option("--repeats", type=click.IntRange(1, 20), default=3, show_default=True,
              help="Transfers per link; the median is reported (a busy CPU only lowers a rate).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Write per-link figures and the summary here.")
def links_command(nodes: int, degree: int, bandwidth: str, scale: float, latency_s: float,
                  latency_method: str, duration_s: float, repeats: int, seed: int,
                  json_path: Path | None) -> None:  # fmt: skip
    """Measures every link's bandwidth and latency against its setting.

    Links are measured one at a time (TCP bulk transfer, then UDP ping-pong) from the lower-named
    end to the other. The bandwidth error compares the rate tbf meters (Ethernet frames) with the
    setting; goodput (TCP payload) is reported beside it.
    """
    low, high = _parse_range(bandwidth)
    sched = BandwidthSchedule(ScheduleConfig(low_bps=low, high_bps=high, scale=scale, seed=seed))
    edges = random_overlay(nodes, degree, seed)
    rates = sched.draw(edges)
    cfg = NetworkConfig(
        nodes=tuple(f"n{i}" for i in range(nodes)),
        links=tuple(LinkSpec(a, b, bps) for (a, b), bps in rates.items()),
        latency_s=latency_s,
        latency_method=latency_method,  # type: ignore[arg-type]  # click.Choice checked it
        queue_s=max(0.05, 4 * latency_s),
    )
    with _root_errors():
        rows = _measure_links(cfg, duration_s, repeats)
    summary = _summary(rows)
    config = {"nodes": nodes, "degree": degree, "bandwidth_mbit": [low / MBIT, high / MBIT],
              "scale": scale, "latency_s": latency_s, "duration_s": duration_s, "repeats": repeats,
              "seed": seed}
    doc = {"mode": "namespaces", "config": config, "links": rows, "summary": summary}
    _print_links_table(rows, summary)
    _write_json(json_path, doc)


def _measure_links(cfg: NetworkConfig, duration_s: float, repeats: int) -> list[dict[str, Any]]:
    rows = []
    _progress(f"building {len(cfg.nodes)} namespaces, {len(cfg.links)} links ...")
    with Network(cfg) as net:
        _progress(f"latency method: {net.latency_method}")
        for i, spec in enumerate(cfg.links, 1):
            a, b = spec.a, spec.b
            _progress(f"[{i}/{len(cfg.links)}] {a}-{b}: set {spec.bandwidth_bps / MBIT:.1f} Mbit/s")
            runs = [bulk_transfer(net.ns(a), net.ns(b), net.address(b), duration_s=duration_s,
                                  warmup_s=max(0.5, 10 * cfg.latency_s), mtu=cfg.mtu)
                    for _ in range(repeats)]  # fmt: skip
            wire = statistics.median(r.wire_bps for r in runs)
            goodput = statistics.median(r.goodput_bps for r in runs)
            pr = ping(net.ns(a), net.ns(b), net.address(b), count=30, interval_s=0.005)
            rows.append(_link_row(spec, wire, goodput, pr, cfg.latency_s))
            rows[-1]["measured_runs_bps"] = [r.wire_bps for r in runs]
            _progress(f"      measured {wire / MBIT:.1f} Mbit/s "
                      f"({rows[-1]['rel_error'] * 100:+.2f}%), one-way "
                      f"{pr.one_way_s * 1e3:.3f} ms")  # fmt: skip
    return rows


def _link_row(spec: LinkSpec, wire: float, goodput: float, pr: PingResult,
              latency_s: float) -> dict[str, Any]:  # fmt: skip
    return {
        "a": spec.a, "b": spec.b,
        "setting_bps": spec.bandwidth_bps, "measured_bps": wire, "goodput_bps": goodput,
        "rel_error": (wire - spec.bandwidth_bps) / spec.bandwidth_bps,
        "latency_setting_s": latency_s, "latency_measured_s": pr.one_way_s,
        "latency_error_s": pr.one_way_s - latency_s,
        "rtt_median_s": pr.median_rtt_s, "pings_lost": pr.lost,
    }  # fmt: skip


def _summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    errs = [abs(r["rel_error"]) for r in rows]
    lat = [abs(r["latency_error_s"]) for r in rows]
    return {
        "links": len(rows),
        "median_abs_rel_error": statistics.median(errs),
        "max_abs_rel_error": max(errs),
        "median_abs_latency_error_s": statistics.median(lat),
        "max_abs_latency_error_s": max(lat),
    }


def _print_links_table(rows: list[dict[str, Any]], summary: dict[str, float]) -> None:
    click.echo(f"{'link':<10}{'set Mbit/s':>12}{'meas Mbit/s':>13}{'goodput':>10}{'error':>9}"
               f"{'set ms':>9}{'one-way ms':>12}")  # fmt: skip
    for r in rows:
        click.echo(f"{r['a'] + '-' + r['b']:<10}{r['setting_bps'] / MBIT:>12.1f}"
                   f"{r['measured_bps'] / MBIT:>13.1f}{r['goodput_bps'] / MBIT:>10.1f}"
                   f"{r['rel_error'] * 100:>8.2f}%{r['latency_setting_s'] * 1e3:>9.2f}"
                   f"{r['latency_measured_s'] * 1e3:>12.3f}")  # fmt: skip
    click.echo(f"bandwidth error: median {summary['median_abs_rel_error'] * 100:.2f}%, "
               f"max {summary['max_abs_rel_error'] * 100:.2f}% over {summary['links']} links; "
               f"latency error: median {summary['median_abs_latency_error_s'] * 1e3:.3f} ms, "
               f"max {summary['max_abs_latency_error_s'] * 1e3:.3f} ms")  # fmt: skip


@main.command("relay-bench")
@click.option("--delay-s", type=click.FloatRange(0.001, 1.0), default=0.02, show_default=True,
              help="The relay's one-way delay target.")
@click.option("--rates", default="100,200,400,600,800,1000,1200", show_default=True,
              help="Offered loads in Mbit/s (paced TCP), comma-separated.")
@click.option("--duration-s", type=click.FloatRange(0.2, 60.0), default=2.0, show_default=True,
              help="Measuring window per load.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Write the figures here.")
def relay_bench_command(delay_s: float, rates: str, duration_s: float,
                        json_path: Path | None) -> None:  # fmt: skip
    """Measures the TUN delay relay: delay accuracy idle and under load, and its ceiling.

    Two devices, one link shaped at 10 Gbit/s (i.e. not limiting), latency by the relay, TCP
    buffers raised to 64 MB in both namespaces so that the window does not limit the flow. For
    each offered load a paced TCP flow runs while UDP ping-pong measures the delay. The ceiling is
    the highest load delivered at >= 90% whose median one-way delay stays within 10% of the
    target.
    """
    offered = _parse_rates(rates)
    cfg = NetworkConfig(nodes=("a", "b"), links=(LinkSpec("a", "b", 10e9),), latency_s=delay_s,
                        latency_method="relay", queue_s=0.05)  # fmt: skip
    with _root_errors():
        doc = _relay_bench(cfg, offered, duration_s)
    _print_relay_table(doc)
    _write_json(json_path, doc)


def _relay_bench(cfg: NetworkConfig, offered: list[float], duration_s: float) -> dict[str, Any]:
    target = cfg.latency_s
    rows: list[dict[str, Any]] = []
    with Network(cfg) as net:
        a, b = net.ns("a"), net.ns("b")
        for node in ("a", "b"):  # room for a 1 Gbit/s x 2 x delay window: TCP must not limit
            net.exec(node, ["sysctl", "-qw", f"net.ipv4.tcp_rmem=4096 131072 {TCP_BUF_MAX}",
                            f"net.ipv4.tcp_wmem=4096 16384 {TCP_BUF_MAX}"])  # fmt: skip
        idle = ping(a, b, net.address("b"), count=100, interval_s=0.002)
        _progress(f"idle: one-way {idle.one_way_s * 1e3:.3f} ms (target {target * 1e3:.1f} ms)")
        loads: list[float | None] = [*offered, None]
        for i, rate in enumerate(loads, 1):
            label = "unpaced" if rate is None else f"{rate / MBIT:.0f} Mbit/s"
            _progress(f"[{i}/{len(loads)}] offered {label} ...")
            row = _loaded_run(net, rate, duration_s, target)
            rows.append(row)
            _progress(f"      delivered {row['delivered_bps'] / MBIT:.1f} Mbit/s, one-way "
                      f"{row['one_way_s'] * 1e3:.3f} ms")  # fmt: skip
    ok = [r["offered_bps"] for r in rows if r["within_tolerance"] and r["offered_bps"]]
    return {
        "target_delay_s": target, "idle_one_way_s": idle.one_way_s,
        "idle_error_s": idle.one_way_s - target,
        "idle_p90_one_way_s": _quantile(idle.rtts_s, 0.9) / 2,
        "ceiling_bps": max(ok) if ok else 0.0, "runs": rows,
        "rule": "ceiling: highest offered load delivered at >= 90% with median one-way delay "
                "within 10% of target",
    }  # fmt: skip


def _loaded_run(net: Network, rate: float | None, duration_s: float,
                target: float) -> dict[str, Any]:  # fmt: skip
    a, b = net.ns("a"), net.ns("b")
    stop = threading.Event()
    result: dict[str, PingResult] = {}
    warmup_s = 0.5

    def pinger() -> None:
        if not stop.wait(warmup_s):  # probe only the measuring window
            result["p"] = ping(a, b, net.address("b"), count=10**6, interval_s=0.01, stop=stop)

    t = threading.Thread(target=pinger, daemon=True)
    t.start()
    try:
        res = bulk_transfer(a, b, net.address("b"), duration_s=duration_s, warmup_s=warmup_s,
                            pacing_bps=rate, mtu=net.config.mtu)  # fmt: skip
    finally:
        stop.set()
        t.join(5.0)
    pr = result.get("p", PingResult((), 0))
    ok_delay = abs(pr.one_way_s - target) <= RELAY_TOLERANCE * target
    delivered_ok = rate is None or res.wire_bps >= RELAY_MIN_DELIVERY * rate
    return {
        "offered_bps": rate, "delivered_bps": res.wire_bps, "goodput_bps": res.goodput_bps,
        "one_way_s": pr.one_way_s, "p90_one_way_s": _quantile(pr.rtts_s, 0.9) / 2,
        "pings": len(pr.rtts_s), "pings_lost": pr.lost,
        "within_tolerance": bool(ok_delay and delivered_ok),
    }  # fmt: skip


def _quantile(xs: tuple[float, ...], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _print_relay_table(doc: dict[str, Any]) -> None:
    t = doc["target_delay_s"]
    click.echo(f"relay target {t * 1e3:.1f} ms; idle one-way {doc['idle_one_way_s'] * 1e3:.3f} ms "
               f"(error {doc['idle_error_s'] * 1e3:+.3f} ms, p90 "
               f"{doc['idle_p90_one_way_s'] * 1e3:.3f} ms)")  # fmt: skip
    click.echo(f"{'offered':>10}{'delivered':>11}{'one-way ms':>12}{'p90 ms':>9}{'error':>9}  ok")
    fmt: Callable[[float | None], str] = lambda v: "max" if v is None else f"{v / MBIT:.0f}"  # noqa: E731
    for r in doc["runs"]:
        err = (r["one_way_s"] - t) / t * 100
        click.echo(f"{fmt(r['offered_bps']):>10}{r['delivered_bps'] / MBIT:>11.1f}"
                   f"{r['one_way_s'] * 1e3:>12.3f}{r['p90_one_way_s'] * 1e3:>9.3f}{err:>8.1f}%"
                   f"  {'yes' if r['within_tolerance'] else 'no'}")  # fmt: skip
    click.echo(f"ceiling (delay within 10%, >= 90% delivered): "
               f"{doc['ceiling_bps'] / MBIT:.0f} Mbit/s")


@main.command("cleanup")
@click.option("--prefix", default="chaos-", show_default=True, help="Namespace prefix of the runs.")
@click.option("--force", is_flag=True, help="Also remove namespaces of runs still alive.")
def cleanup_command(prefix: str, force: bool) -> None:
    """Removes namespaces (and their processes) and CPU budget groups left by crashed runs."""
    with _root_errors():
        try:
            removed = cleanup_stale(prefix, force=force)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--prefix") from e
    click.echo(f"removed {len(removed)} namespace(s)" + "".join(f"\n  {ns}" for ns in removed))
    from chaos.emulate.cpu_budget import cleanup_stale_groups

    groups = cleanup_stale_groups()
    if groups:
        click.echo(f"removed {len(groups)} CPU budget group(s) of dead runs"
                   + "".join(f"\n  {g}" for g in groups))  # fmt: skip


def _register_run_commands() -> None:
    from chaos.emulate.commands import (
        chaos_command,
        chaos_report_command,
        compare_command,
        compare_plot_command,
        demo_command,
        run_command,
    )
    from chaos.emulate.train_bench_run import train_command

    for cmd in (demo_command, run_command, compare_command, compare_plot_command, chaos_command,
                chaos_report_command, train_command):  # fmt: skip
        main.add_command(cmd)


_register_run_commands()


if __name__ == "__main__":  # pragma: no cover
    main()
