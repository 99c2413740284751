"""``chaos-daemon``: start a daemon, or talk to one.

Commands::

    chaos-daemon start --id ID --listen tcp://HOST:PORT [--join tcp://HOST:PORT]
                       [--neighbor ID ...] [--config FILE.toml] [--heartbeat-interval S]
                       [--failure-timeout S] [--metrics-port P]
    chaos-daemon status [--connect tcp://HOST:PORT] [--json]
    chaos-daemon leave [--connect tcp://HOST:PORT]
    chaos-daemon link add|remove PEER_ID [--connect tcp://HOST:PORT]
    chaos-daemon fault NAME [PEER_ID ...] [--connect tcp://HOST:PORT]   (testing only)

Environment variables are read here and nowhere else:

* ``CHAOS_DAEMON_DIR``: the run directory (IPC socket, default event log); one daemon per run
  directory. It also tells the client commands which local daemon to talk to.
* ``CHAOS_DAEMON_LOG_LEVEL``: ``logging`` level of ``start`` (default ``INFO``).

Precedence: flags and these variables over the TOML file over the defaults.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from typing import Any

import click
import msgspec
from chaos.daemon.client import DaemonClient
from chaos.daemon.config import (
    REPLICATION_STRATEGIES,
    default_run_dir,
    ipc_endpoint_for,
    load_config,
)

from chaos.errors import ChaosError, ChaosTimeout, ConfigError
from chaos.protocol import FaultName, StatusReply
from chaos.protocol.ids import NODE_ID_RULE, check_node_id, check_tcp_endpoint

_ENV_DIR = "CHAOS_DAEMON_DIR"
_ENV_LOG = "CHAOS_DAEMON_LOG_LEVEL"
_CONNECT_HELP = "Talk to the daemon at this TCP endpoint instead of the local one."


def _local_endpoint() -> str:
    return ipc_endpoint_for(os.environ.get(_ENV_DIR) or default_run_dir())


def _client(connect: str | None) -> DaemonClient:
    if connect is not None:
        try:
            check_tcp_endpoint(connect, "--connect endpoint")
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--connect") from exc
    try:
        return DaemonClient(connect or _local_endpoint())
    except ChaosError as exc:
        raise click.ClickException(str(exc)) from exc


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Chaos control-plane daemon: one per device."""


@main.command()
@click.option("--id", "node_id", help=f"Unique node id ({NODE_ID_RULE}).")
@click.option("--listen", help="TCP endpoint to bind, tcp://HOST:PORT.")
@click.option("--join", help="A member's endpoint; without it a new cluster starts.")
@click.option("--neighbor", "neighbors", multiple=True, help="Wanted overlay neighbour (repeat).")
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    help="TOML file with DaemonConfig fields.",
)
@click.option("--heartbeat-interval", type=float, help="Heartbeat period in seconds (0.5).")
@click.option("--failure-timeout", type=float, help="Silence before a node is failed (1.5 s).")
@click.option("--metrics-port", type=int, help="Serve Prometheus metrics on this port.")
@click.option(
    "--replication-strategy",
    type=click.Choice(list(REPLICATION_STRATEGIES)),
    help="How a joiner's state is sourced (chaos).",
)
def start(
    node_id: str | None,
    listen: str | None,
    join: str | None,
    neighbors: tuple[str, ...],
    config_file: str | None,
    heartbeat_interval: float | None,
    failure_timeout: float | None,
    metrics_port: int | None,
    replication_strategy: str | None,
) -> None:
    """Run a daemon in the foreground; SIGINT, SIGTERM and SIGHUP make it leave gracefully.

    A signal ignored when the daemon starts stays ignored.
    """
    cli: dict[str, Any] = {
        "node_id": node_id,
        "listen": listen,
        "join": join,
        "neighbors": tuple(neighbors),
        "heartbeat_interval_s": heartbeat_interval,
        "failure_timeout_s": failure_timeout,
        "metrics_port": metrics_port,
        "replication_strategy": replication_strategy,
        "run_dir": os.environ.get(_ENV_DIR) or None,
    }
    try:
        cfg = load_config(cli, config_file)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    level = os.environ.get(_ENV_LOG, "INFO").upper()
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    _refuse_if_running(cfg.resolved_ipc_endpoint)
    from chaos.daemon.node import Daemon

    try:
        daemon = Daemon(cfg)
    except (ConfigError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    signal.set_wakeup_fd(daemon.transport.wakeup_fd(), warn_on_full_buffer=False)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        # a signal ignored at start stays ignored: a background job's SIGINT, nohup's SIGHUP,
        # and a Trainer's embedded daemon, which leaves when its script asks it to (or on SIGHUP
        # when the script dies), not on the signals meant for the script
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, lambda *_: daemon.request_leave())
    sys.exit(daemon.run())


def _refuse_if_running(endpoint: str) -> None:
    if not os.path.exists(endpoint.removeprefix("ipc://")):
        return
    try:
        with DaemonClient(endpoint, timeout_s=0.3) as c:
            st = c.status()
    except (ChaosTimeout, ChaosError):
        return  # a stale socket file: the transport replaces it
    raise click.ClickException(
        f"daemon {st.node_id!r} already runs at {endpoint}; set {_ENV_DIR} to run another"
    )


def _status_dict(st: StatusReply) -> dict[str, Any]:
    links = [
        {
            "a": x.a,
            "b": x.b,
            "bandwidth_bps": x.bandwidth_bps,
            "latency_s": x.latency_s,
            "tau_sync_s": x.tau_sync_s,
            "up": x.up,
        }
        for x in st.links
    ]
    return {
        "node_id": st.node_id,
        "role": st.role,
        "state": st.state,
        "paused": st.paused,
        "scheduler": st.scheduler,
        "term": st.term,
        "epoch": st.epoch,
        "nodes": msgspec.to_builtins(st.nodes),
        "links": links,
        "sync": msgspec.to_builtins(st.sync) if st.sync else None,
        "notes": list(st.notes),
    }


def _fmt(v: float | None, scale: float, unit: str) -> str:
    return "-" if v is None else f"{v * scale:.3g}{unit}"


@main.command()
@click.option("--connect", help=_CONNECT_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status(connect: str | None, as_json: bool) -> None:
    """Show the cluster as this daemon sees it."""
    with _client(connect) as c:
        try:
            st = c.status()
        except ChaosError as exc:
            raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps(_status_dict(st), indent=2))
        return
    paused = "  PAUSED (no majority)" if st.paused else ""
    click.echo(f"node {st.node_id}  role {st.role}  state {st.state}{paused}")
    click.echo(f"scheduler {st.scheduler or '-'}  term {st.term}  epoch {st.epoch}")
    click.echo(f"{'ID':<12}{'STATE':<9}{'TRAINER':<10}{'ADDRESS':<24}{'JOINED':<10}NEIGHBORS")
    for n in st.nodes:
        joined = time.strftime("%H:%M:%S", time.localtime(n.joined_at))
        nbrs = ",".join(n.neighbors)
        state, trainer = n.state.value, n.trainer.value
        click.echo(f"{n.id:<12}{state:<9}{trainer:<10}{n.address:<24}{joined:<10}{nbrs}")
    click.echo(f"{'LINK':<20}{'UP':<5}{'BANDWIDTH':<18}LATENCY")
    for x in st.links:
        bw = _fmt(x.bandwidth_bps, 1e-6, " Mbit/s") + " "
        lat = _fmt(x.latency_s, 1e3, " ms")
        click.echo(f"{x.a + '-' + x.b:<20}{'yes' if x.up else 'NO':<5}{bw:<18}{lat}")
    if st.sync is not None and not st.sync.nodes:
        click.echo("sync policy: none (no trainer registered)")
    elif st.sync is not None:
        extra = f" root {st.sync.root}" if st.sync.kind == "tree" else " " + "-".join(st.sync.ring)
        click.echo(f"sync policy: {st.sync.kind}{extra}")
    for note in st.notes:
        click.echo(f"note: {note}")


def _report(result: Any, what: str) -> None:
    if result.ok:
        click.echo(f"{what}: ok (epoch {result.epoch}, {result.elapsed_s * 1e3:.2f} ms)")
        return
    reason = getattr(result.reason, "value", result.reason)
    raise click.ClickException(f"{what} failed: {reason} {result.detail}".strip())


@main.command()
@click.option("--connect", help=_CONNECT_HELP)
def leave(connect: str | None) -> None:
    """Leave the cluster gracefully (scale-in); the daemon then exits."""
    with _client(connect) as c:
        try:
            _report(c.leave(), "leave")
        except ChaosError as exc:
            raise click.ClickException(str(exc)) from exc


@main.group()
def link() -> None:
    """Add or remove an overlay link of this daemon."""


def _link(peer: str, add: bool, connect: str | None) -> None:
    try:
        check_node_id(peer, "PEER_ID")
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="PEER_ID") from exc
    with _client(connect) as c:
        try:
            _report(c.link(peer, add), f"link {'add' if add else 'remove'} {peer}")
        except ChaosError as exc:
            raise click.ClickException(str(exc)) from exc


@link.command("add")
@click.argument("peer_id")
@click.option("--connect", help=_CONNECT_HELP)
def link_add(peer_id: str, connect: str | None) -> None:
    """Connect-link to PEER_ID."""
    _link(peer_id, True, connect)


@link.command("remove")
@click.argument("peer_id")
@click.option("--connect", help=_CONNECT_HELP)
def link_remove(peer_id: str, connect: str | None) -> None:
    """Disconnect-link from PEER_ID."""
    _link(peer_id, False, connect)


@main.command()
@click.argument(
    "name", type=click.Choice(["drop_to", "drop_from", "cut_link", "partition", "clear"])
)
@click.argument("peers", nargs=-1)
@click.option("--connect", help=_CONNECT_HELP)
def fault(name: FaultName, peers: tuple[str, ...], connect: str | None) -> None:
    """Inject a named transport fault (testing and the harness only)."""
    for p in peers:
        try:
            check_node_id(p, "PEER_ID")
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="PEERS") from exc
    with _client(connect) as c:
        try:
            reply = c.fault(name, list(peers))
        except ChaosError as exc:
            raise click.ClickException(str(exc)) from exc
    click.echo("active faults: " + (", ".join(reply.active) or "none"))


if __name__ == "__main__":  # pragma: no cover
    main()
