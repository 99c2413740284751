"""``chaos-daemon``: start a daemon, or talk to one.

Commands::

    chaos-daemon keygen FILE
    chaos-daemon metrics-token [--cluster-key FILE] [--out FILE]
    chaos-daemon start --id ID --listen tcp://HOST:PORT [--join tcp://HOST:PORT[,...] ...]
                       [--neighbor ID ...] [--config FILE.toml] [--heartbeat-interval S]
                       [--failure-timeout S] [--metrics-port P] [--metrics-host HOST]
                       [--metrics-max-connections N] [--metrics-idle-timeout S]
                       [--metrics-threads N]
                       [--cluster-key FILE] [--insecure] [--enable-fault-injection]
                       [--allow-remote-operator]
                       [--fault NAME:PEER,...] [--max-peer-sockets N] [--max-measurements N]
                       [--join-rate R] [--join-burst N] [--straggler-grace S]
                       [--behind-grace S] [--offender-limit N] [--offender-window STEPS]
                       [--join-timeout S]
    chaos-daemon status [--connect tcp://HOST:PORT] [--cluster-key FILE] [--json]
    chaos-daemon dashboard [--connect tcp://HOST:PORT] [--cluster-key FILE] [--port P]
    chaos-daemon leave [--connect tcp://HOST:PORT] [--cluster-key FILE]
    chaos-daemon link add|remove PEER_ID [--connect tcp://HOST:PORT] [--cluster-key FILE]
    chaos-daemon fault NAME [PEER_ID ...] [--connect tcp://HOST:PORT] [--cluster-key FILE]
                                                                   (testing only)

Environment variables are read here and nowhere else:

* ``CHAOS_DAEMON_DIR``: the run directory (IPC socket, default event log); one daemon per run
  directory. It also tells the client commands which local daemon to talk to.
* ``CHAOS_DAEMON_LOG_LEVEL``: ``logging`` level of ``start`` (default ``INFO``).
* ``CHAOS_CLUSTER_KEY``: the cluster key file, when ``--cluster-key`` is not given (``start``
  and the client commands).

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
    DaemonConfig,
    default_run_dir,
    ensure_private_run_dir,
    ipc_endpoint_for,
    load_config,
    parse_join_endpoints,
)
from chaos.daemon.metrics import metrics_token

from chaos.errors import ChaosError, ChaosTimeout, ConfigError
from chaos.protocol import FaultName, StatusReply
from chaos.protocol.ids import (
    NODE_ID_RULE,
    check_node_id,
    check_tcp_endpoint,
    is_loopback_endpoint,
)
from chaos.security import ClusterKey, Security

_ENV_DIR = "CHAOS_DAEMON_DIR"
_ENV_LOG = "CHAOS_DAEMON_LOG_LEVEL"
_ENV_KEY = "CHAOS_CLUSTER_KEY"
_CONNECT_HELP = "Talk to the daemon at this TCP endpoint instead of the local one."
_KEY_HELP = f"Cluster key file (chaos-daemon keygen; default ${_ENV_KEY})."


def _local_endpoint() -> str:
    return ipc_endpoint_for(os.environ.get(_ENV_DIR) or default_run_dir())


def _key_file(option: str | None) -> str | None:
    """The cluster key file: the option, else ``CHAOS_CLUSTER_KEY`` (``None``: no key)."""
    return option or os.environ.get(_ENV_KEY) or None


def _client(connect: str | None, cluster_key: str | None = None) -> DaemonClient:
    if connect is not None:
        try:
            check_tcp_endpoint(connect, "--connect endpoint")
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="--connect") from exc
    key = _key_file(cluster_key)
    try:
        security = Security.from_key_file(key) if key is not None else None
        return DaemonClient(connect or _local_endpoint(), security=security)
    except ChaosError as exc:
        raise click.ClickException(str(exc)) from exc


def _key_option(fn: Any) -> Any:
    return click.option("--cluster-key", type=click.Path(dir_okay=False), help=_KEY_HELP)(fn)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Chaos control-plane daemon: one per device."""


@main.command()
@click.argument("file", type=click.Path(dir_okay=False))
def keygen(file: str) -> None:
    """Write a new cluster key to FILE (mode 0600; an existing file is never overwritten).

    Every daemon and client given the file (--cluster-key, or $CHAOS_CLUSTER_KEY) belongs to
    the cluster: keep it secret, copy it only to the cluster's hosts.
    """
    key = ClusterKey.generate()
    try:
        path = key.write(file)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"wrote cluster key {path} (fingerprint {key.fingerprint()})")


@main.command("metrics-token")
@_key_option
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    help="Write the token to this file (mode 0600, replaced if it exists) instead of stdout.",
)
def metrics_token_command(cluster_key: str | None, out: str | None) -> None:
    """Print the bearer token the metrics endpoint of a keyed daemon requires.

    Every daemon with this cluster key expects the same token (derived from the key; it does not
    reveal the key). Give it to Prometheus as the scrape job's authorization credentials_file.
    """
    key_file = _key_file(cluster_key)
    if key_file is None:
        raise click.UsageError(
            f"no cluster key: pass --cluster-key FILE or set ${_ENV_KEY} (a daemon without a "
            "key asks for no token)"
        )
    try:
        token = metrics_token(ClusterKey.load(key_file))
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    if out is None:
        click.echo(token)
        return
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, f"{token}\n".encode())
        finally:
            os.close(fd)
    except OSError as exc:
        raise click.ClickException(f"cannot write {out}: {exc.strerror}") from exc
    click.echo(f"wrote the metrics token to {out}")


@main.command()
@click.option("--id", "node_id", help=f"Unique node id ({NODE_ID_RULE}).")
@click.option("--listen", help="TCP endpoint to bind, tcp://HOST:PORT.")
@click.option(
    "--join",
    multiple=True,
    help="Members' endpoints to join through, tried in turn (repeat, or separate with commas); "
    "without it a new cluster starts.",
)
@click.option("--neighbor", "neighbors", multiple=True, help="Wanted overlay neighbour (repeat).")
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    help="TOML file with DaemonConfig fields.",
)
@click.option("--heartbeat-interval", type=float, help="Heartbeat period in seconds (0.5).")
@click.option("--failure-timeout", type=float, help="Silence before a node is failed (1.5 s).")
@click.option(
    "--straggler-grace",
    type=float,
    help="A trainer without step progress this long, while others wait, is evicted (10 s; 0: off).",
)
@click.option(
    "--behind-grace",
    type=float,
    help="A trainer waiting a step behind the others this long is evicted (3 s; 0: off).",
)
@click.option(
    "--offender-limit",
    type=int,
    help="A device named in this many skipped non-finite steps is evicted (3; 0: off).",
)
@click.option(
    "--offender-window",
    type=int,
    help="... within this many steps (100).",
)
@click.option("--metrics-port", type=int, help="Serve Prometheus metrics on this port.")
@click.option(
    "--metrics-host", help="Address the metrics endpoint binds (default: loopback)."
)
@click.option(
    "--metrics-max-connections", type=int, help="Most metrics connections open at once (32)."
)
@click.option(
    "--metrics-idle-timeout",
    type=float,
    help="An idle metrics connection is closed after this long (10 s; whole seconds).",
)
@click.option("--metrics-threads", type=int, help="Threads answering metrics requests (2).")
@click.option(
    "--replication-strategy",
    type=click.Choice(list(REPLICATION_STRATEGIES)),
    help="How a joiner's state is sourced (chaos).",
)
@_key_option
@click.option(
    "--insecure",
    is_flag=True,
    default=None,
    help="Allow a non-loopback --listen without a cluster key (anyone reaching it controls it).",
)
@click.option(
    "--enable-fault-injection",
    is_flag=True,
    default=None,
    help="Accept the fault command and --fault presets (tests and the harness only).",
)
@click.option(
    "--allow-remote-operator",
    is_flag=True,
    default=None,
    help="Accept leave, link and fault over TCP from any cluster key holder (default: only on "
    "the local IPC socket). Needs --cluster-key.",
)
@click.option(
    "--fault", "faults", multiple=True, help="Fault active from the start, NAME:PEER,... (repeat)."
)
@click.option("--max-peer-sockets", type=int, help="Most peer sockets open at once (512).")
@click.option("--max-measurements", type=int, help="Most link measurements at once (64).")
@click.option("--join-rate", type=float, help="Join requests accepted per second (20).")
@click.option("--join-burst", type=int, help="Join requests accepted at once (64).")
@click.option(
    "--join-timeout",
    type=float,
    help="A joiner not admitted within this long exits with an error (30 s).",
)
def start(
    node_id: str | None,
    listen: str | None,
    join: tuple[str, ...],
    neighbors: tuple[str, ...],
    config_file: str | None,
    heartbeat_interval: float | None,
    failure_timeout: float | None,
    straggler_grace: float | None,
    behind_grace: float | None,
    offender_limit: int | None,
    offender_window: int | None,
    metrics_port: int | None,
    metrics_host: str | None,
    metrics_max_connections: int | None,
    metrics_idle_timeout: float | None,
    metrics_threads: int | None,
    replication_strategy: str | None,
    cluster_key: str | None,
    insecure: bool | None,
    enable_fault_injection: bool | None,
    allow_remote_operator: bool | None,
    faults: tuple[str, ...],
    max_peer_sockets: int | None,
    max_measurements: int | None,
    join_rate: float | None,
    join_burst: int | None,
    join_timeout: float | None,
) -> None:
    """Run a daemon in the foreground; SIGINT, SIGTERM and SIGHUP make it leave gracefully.

    A signal ignored when the daemon starts stays ignored.
    """
    cli: dict[str, Any] = {
        "node_id": node_id,
        "listen": listen,
        "join": parse_join_endpoints(join),
        "neighbors": tuple(neighbors),
        "heartbeat_interval_s": heartbeat_interval,
        "failure_timeout_s": failure_timeout,
        "straggler_grace_s": straggler_grace,
        "behind_grace_s": behind_grace,
        "offender_limit": offender_limit,
        "offender_window_steps": offender_window,
        "metrics_port": metrics_port,
        "metrics_host": metrics_host,
        "metrics_max_connections": metrics_max_connections,
        "metrics_idle_timeout_s": metrics_idle_timeout,
        "metrics_threads": metrics_threads,
        "replication_strategy": replication_strategy,
        "run_dir": os.environ.get(_ENV_DIR) or None,
        "cluster_key": _key_file(cluster_key),
        "insecure": insecure,
        "enable_fault_injection": enable_fault_injection,
        "allow_remote_operator": allow_remote_operator,
        "faults": tuple(faults),
        "max_peer_sockets": max_peer_sockets,
        "max_measurements": max_measurements,
        "join_rate_per_s": join_rate,
        "join_burst": join_burst,
        "join_timeout_s": join_timeout,
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
    _warn_if_exposed(cfg)
    try:
        ensure_private_run_dir(cfg.run_dir)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
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


def _warn_if_exposed(cfg: DaemonConfig) -> None:
    """Warns on stderr when the daemon listens beyond loopback without a cluster key."""
    if cfg.cluster_key is None and not is_loopback_endpoint(cfg.listen):
        click.echo(
            f"WARNING: --insecure: listening on {cfg.listen} without a cluster key. Anyone who "
            "can reach this address can join the cluster, read its state and make members "
            "join, leave or re-link. Create a key with 'chaos-daemon keygen FILE' and pass "
            "--cluster-key FILE to every daemon instead.",
            err=True,
        )
    host = cfg.resolved_metrics_host
    if cfg.metrics_port is not None and not is_loopback_endpoint(f"tcp://[{host}]:1"):
        click.echo(
            f"WARNING: --metrics-host {host}: the metrics endpoint is plain HTTP. It asks for "
            "the bearer token (chaos-daemon metrics-token), but the token and the metrics "
            "cross the network in the clear. Firewall it to your monitoring host.",
            err=True,
        )
    if cfg.enable_fault_injection:
        click.echo(
            "WARNING: --enable-fault-injection: the fault command can cut this daemon's links "
            "(tests and the harness only).",
            err=True,
        )


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
        "audit": msgspec.to_builtins(st.audit) if st.audit else None,
        "activity": msgspec.to_builtins(st.activity),
        "joins": msgspec.to_builtins(st.joins),
        "events": msgspec.to_builtins(st.events),
        "trainer_phase": st.trainer_phase.value if st.trainer_phase else None,
    }


def _fmt(v: float | None, scale: float, unit: str) -> str:
    return "-" if v is None else f"{v * scale:.3g}{unit}"


@main.command()
@click.option("--connect", help=_CONNECT_HELP)
@_key_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status(connect: str | None, cluster_key: str | None, as_json: bool) -> None:
    """Show the cluster as this daemon sees it."""
    with _client(connect, cluster_key) as c:
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
    # TAU_SYNC: a donor's measured start delay in the last replication plan over the link
    click.echo(f"{'LINK':<20}{'UP':<5}{'BANDWIDTH':<18}{'LATENCY':<12}TAU_SYNC")
    for x in st.links:
        bw = _fmt(x.bandwidth_bps, 1e-6, " Mbit/s") + " "
        lat = _fmt(x.latency_s, 1e3, " ms")
        tau = _fmt(x.tau_sync_s, 1e3, " ms")
        click.echo(f"{x.a + '-' + x.b:<20}{'yes' if x.up else 'NO':<5}{bw:<18}{lat:<12}{tau}")
    if st.sync is not None and not st.sync.nodes:
        click.echo("sync policy: none (no trainer registered)")
    elif st.sync is not None:
        extra = f" root {st.sync.root}" if st.sync.kind == "tree" else " " + "-".join(st.sync.ring)
        click.echo(f"sync policy: {st.sync.kind}{extra}")
    if st.trainer_phase is not None:
        click.echo(f"this node's trainer: {st.trainer_phase.value}")
    if st.audit is not None:
        a = st.audit
        verdict = "agreed" if a.agreed else "MEMBERS DIFFERED"
        click.echo(f"state audit: last step {a.step} {verdict}  ({a.audits} audits, "
                   f"{a.mismatches} mismatches, {a.healed} healed here)")  # fmt: skip
    for a in st.activity:
        rate = f"{a.steps_per_s:.1f} steps/s" if a.steps_per_s else "rate not measured yet"
        phase = f"{a.phase.value}, " if a.phase is not None else ""
        click.echo(f"training: {a.id} step {a.step} ({phase}{rate}, heard {a.heard_s:.1f} s ago)")
    for j in st.joins:
        phase = f" [{j.phase.value}]" if j.phase is not None else ""
        if j.pull is None:
            click.echo(f"joining: {j.id}{phase} (no pull reported yet)")
            continue
        p = j.pull
        click.echo(f"joining: {j.id}{phase} pulled {p.pulled_bytes / 1e6:.1f} of "
                   f"{p.total_bytes / 1e6:.1f} MB from {', '.join(j.donors) or '-'}")  # fmt: skip
    for note in st.notes:
        click.echo(f"note: {note}")


@main.command()
@click.option("--connect", help=_CONNECT_HELP)
@_key_option
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
def doctor(connect: str | None, cluster_key: str | None, as_json: bool) -> None:
    """Check this daemon's setup: membership, advertised address, scheduler, links, trainer.

    Prints each check, worst first, with what to do about one that is not ok; exits 1 when a
    check fails.
    """
    from chaos.daemon.client_ops import call_doctor  # the daemon's modules: only here

    with _client(connect, cluster_key) as c:
        try:
            reply = call_doctor(c)
        except ChaosError as exc:
            raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps({"checks": msgspec.to_builtins(reply.checks)}, indent=2))
    else:
        for check in reply.checks:
            click.echo(f"{check.status.upper():<5}{check.name}: {check.detail}")
            if check.fix:
                click.echo(f"     fix: {check.fix}")
    if any(check.status == "fail" for check in reply.checks):
        raise SystemExit(1)


@main.command()
@click.option("--connect", help=_CONNECT_HELP)
@_key_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address the page binds (another than loopback needs --cluster-key).")
@click.option("--port", type=click.IntRange(0, 65535), default=8470, show_default=True,
              help="TCP port of the page (0: any free one).")
@click.option("--interval", type=click.FloatRange(0.05, 3600.0), default=1.0, show_default=True,
              help="Seconds between two polls of the daemons.")
def dashboard(connect: str | None, cluster_key: str | None, host: str, port: int,
              interval: float) -> None:  # fmt: skip
    """Serve a live, read-only web view of the cluster (until Ctrl+C).

    It polls this daemon (or the one at --connect) and the scheduler for their status. With a
    cluster key every request needs the token printed here (derived from the key).
    """
    from chaos.daemon.dashboard import Dashboard, DashboardConfig

    try:
        cfg = DashboardConfig(connect=connect or _local_endpoint(), host=host, port=port,
                              interval_s=interval, key_file=_key_file(cluster_key))  # fmt: skip
        board = Dashboard(cfg)
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from exc
    except (ChaosError, OSError) as exc:
        raise click.ClickException(f"cannot start the dashboard: {exc}") from exc
    click.echo(f"dashboard of {cfg.connect}: {board.url}", err=True)
    first = board.poller.document()
    if not first.get("ok"):
        click.echo(f"note: no answer from the daemon yet ({first.get('error')}); "
                   "the page says so until it answers", err=True)  # fmt: skip
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        board.close()


def _report(result: Any, what: str) -> None:
    if result.ok:
        click.echo(f"{what}: ok (epoch {result.epoch}, {result.elapsed_s * 1e3:.2f} ms)")
        return
    reason = getattr(result.reason, "value", result.reason)
    raise click.ClickException(f"{what} failed: {reason} {result.detail}".strip())


@main.command()
@click.option("--connect", help=_CONNECT_HELP)
@_key_option
def leave(connect: str | None, cluster_key: str | None) -> None:
    """Leave the cluster gracefully (scale-in); the daemon then exits.

    Over --connect (TCP) it needs the cluster key; the local daemon always accepts it.
    """
    with _client(connect, cluster_key) as c:
        try:
            _report(c.leave(), "leave")
        except ChaosError as exc:
            raise click.ClickException(str(exc)) from exc


@main.group()
def link() -> None:
    """Add or remove an overlay link of this daemon."""


def _link(peer: str, add: bool, connect: str | None, cluster_key: str | None) -> None:
    try:
        check_node_id(peer, "PEER_ID")
    except ConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="PEER_ID") from exc
    with _client(connect, cluster_key) as c:
        try:
            _report(c.link(peer, add), f"link {'add' if add else 'remove'} {peer}")
        except ChaosError as exc:
            raise click.ClickException(str(exc)) from exc


@link.command("add")
@click.argument("peer_id")
@click.option("--connect", help=_CONNECT_HELP)
@_key_option
def link_add(peer_id: str, connect: str | None, cluster_key: str | None) -> None:
    """Connect-link to PEER_ID."""
    _link(peer_id, True, connect, cluster_key)


@link.command("remove")
@click.argument("peer_id")
@click.option("--connect", help=_CONNECT_HELP)
@_key_option
def link_remove(peer_id: str, connect: str | None, cluster_key: str | None) -> None:
    """Disconnect-link from PEER_ID."""
    _link(peer_id, False, connect, cluster_key)


@main.command()
@click.argument(
    "name", type=click.Choice(["drop_to", "drop_from", "cut_link", "partition", "clear"])
)
@click.argument("peers", nargs=-1)
@click.option("--connect", help=_CONNECT_HELP)
@_key_option
def fault(
    name: FaultName, peers: tuple[str, ...], connect: str | None, cluster_key: str | None
) -> None:
    """Inject a named transport fault (testing and the harness only).

    The daemon must run with --enable-fault-injection.
    """
    for p in peers:
        try:
            check_node_id(p, "PEER_ID")
        except ConfigError as exc:
            raise click.BadParameter(str(exc), param_hint="PEERS") from exc
    with _client(connect, cluster_key) as c:
        try:
            reply = c.fault(name, list(peers))
        except ChaosError as exc:
            raise click.ClickException(str(exc)) from exc
    click.echo("active faults: " + (", ".join(reply.active) or "none"))


if __name__ == "__main__":  # pragma: no cover
    main()
