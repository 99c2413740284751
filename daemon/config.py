"""The daemon's configuration: one frozen dataclass, validated once.

Precedence (documented once, here and in ``docs/daemon.md``): **command-line flags (and the
``CHAOS_DAEMON_*`` environment variables, read only by the CLI) over the TOML file over the
defaults below.** :func:`load_config` merges the three layers; nothing else re-derives defaults.

TOML keys are the field names below (e.g. ``heartbeat_interval_s = 0.5``); an unknown key is an
error, so a typo never goes unnoticed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import stat
import tempfile
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.errors import ConfigError
from chaos.protocol import DEFAULT_MAX_FRAME_BYTES
from chaos.protocol.ids import check_node_id, check_tcp_endpoint, is_loopback_endpoint
from chaos.security import ClusterKey


def default_run_dir() -> str:
    """The default run directory: ``$TMPDIR/chaos-<uid>`` (one daemon per run directory)."""
    base = os.environ.get("TMPDIR", "/tmp")
    return str(Path(base) / f"chaos-{os.getuid()}")


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a positive finite number, got {value!r}")


REPLICATION_STRATEGIES: tuple[str, ...] = ("chaos", "even", "single-source", "multi-source")
"""Values of :attr:`DaemonConfig.replication_strategy`."""


@dataclass(frozen=True)
class DaemonConfig:
    """Configuration of one ``chaos-daemon``.

    Args:
        node_id: This node's unique id.
        listen: TCP endpoint the daemon's ROUTER binds, ``tcp://HOST:PORT``. Peers reach it here.
        join: Members' endpoints to join through, tried in turn (the next one when a contact
            refuses for want of a scheduler or stays silent); empty starts a new cluster. Name
            several where a contact may be paused or gone (see :func:`parse_join_endpoints`).
        neighbors: Ids of the overlay neighbours wanted at join time. Empty: the node it joins
            through.
        heartbeat_interval_s: Heartbeat period. Lower detects failures sooner at more traffic.
        failure_timeout_s: A member silent this long is failed (scale-in). Keep it at least
            three heartbeat intervals on lossy links.
        election_timeout_min_s: Lower bound of the randomized Raft election timeout
            (``None``: ``failure_timeout_s``).
        election_timeout_max_s: Upper bound (``None``: twice ``failure_timeout_s``). A wider range
            avoids split votes; a narrower one elects sooner.
        link_probe_interval_s: Period of the light latency probes on each overlay link.
        link_failure_timeout_s: A link without a probe answer this long is reported down
            (disconnect-link). Must exceed ``failure_timeout_s`` so that a dead node is detected
            as a node failure first.
        bandwidth_probe_bytes: Size of the timed bulk transfer that measures a new link. Larger is
            more accurate on fast links and slower on slow ones.
        bandwidth_probe_chunk_bytes: Chunk size of that transfer (must fit ``max_frame_bytes``).
        keep_probe_memory: Make glibc keep the freed buffers of received probe chunks mapped
            for reuse (:mod:`chaos.allocator`; process-wide). Saves the kernel zeroing the
            4 MiB of fresh pages of every probe this daemon receives, CPU that on a small device
            is taken from training. Turn it off where the daemon must give freed memory back at
            once.
        probe_timeout_s: Give up a link measurement after this long.
        default_bandwidth_bps: Bandwidth assumed for a link before it is measured.
        sync_message_bytes: Gradient size assumed when comparing tree and ring sync policies.
        sync_switch_min_gain: The sync policy's structure is replaced (every trainer re-wires)
            only when the new one is estimated faster by at least this fraction of the current
            one's time, or the current one no longer applies. Raise it where link measurements
            are noisy; 0 follows every improvement.
        per_shard_cost_s: The prior of the per-shard message cost c (seconds) of the replication
            planner: the value it plans with until a pull has been measured. Each completed
            pull's report refits c (the scheduler's monitor keeps a smoothed estimate, shown by
            ``chaos-daemon status``), which then replaces this value. Set it to what
            ``chaos-bench shard-cost`` measures on the data-plane transport when the first
            joins matter; a higher c makes the planner choose fewer, larger shards.
        replication_strategy: How a joiner's state is sourced (the harness compares them):
            ``"chaos"`` (default; Algorithms 1 and 2 over the joiner's training neighbours),
            ``"even"`` (equal split over the same neighbours), ``"single-source"`` (the fastest
            neighbour only, as in EDL+) or ``"multi-source"`` (equal split over every training
            member, multi-hop, as in Autoscaling).
        straggler_grace_s: A trainer silent this long (no step progress) while other trainers
            have waited this long in their allreduce is evicted from the sync policy as a
            straggler (event ``straggler_evicted``); it rejoins as a joiner when it resumes.
            Set it above the longest step time of the slowest device (a device that is merely
            slow sets the pace and is never evicted). 0 turns the check off.
        behind_grace_s: A trainer heard waiting in ``update()`` at a step older than the one
            other trainers wait at, all of them this long, missed a round's result and is
            evicted (it joins again, pulling the state the others reached). Members at two
            steps never happens in normal training, and a neighbour hands the missed result
            over in milliseconds when it can, so this is shorter than ``straggler_grace_s``;
            raise it only if progress reports are delayed (it must exceed 2 heartbeat
            intervals). 0 turns the check off.
        offender_limit: A device whose gradients made this many steps non-finite (each step
            named by a majority of the training members, which all skipped it) within
            ``offender_window_steps`` steps is evicted from the sync policy (event
            ``offender_evicted``); it joins again, pulling the state, and its count starts
            afresh. 0 turns the rule off.
        offender_window_steps: The window of ``offender_limit``, in training steps.
        join_timeout_s: A joiner that is not admitted within this long exits with an error.
        op_timeout_s: A primitive whose policy is not acknowledged by every member within this
            long completes as failed.
        leave_timeout_s: How long a graceful leave (SIGINT/SIGTERM, ``leave``) waits.
        resource_interval_s: Period of the psutil resource samples.
        max_frame_bytes: Largest accepted frame; bigger ones are refused (``too_large``).
        metrics_port: Serve Prometheus metrics on this port (``None``: off).
        run_dir: Directory of the IPC socket and the default event log.
        ipc_endpoint: Local endpoint for the CLI and the trainer (``None``:
            ``ipc://<run_dir>/daemon.ipc``).
        event_log: JSONL event log path (``None``: ``<run_dir>/events-<node_id>.jsonl``).
        faults: Named transport faults active from the start, e.g. ``["drop_to:n2"]``
            (test and harness use only).
        cluster_key: Path of the cluster key file (``chaos-daemon keygen``). Every socket then
            authenticates peers and encrypts traffic; only key holders can join or talk to the
            daemon over TCP. ``None``: no key, allowed only on a loopback ``listen`` address
            unless ``insecure`` is set.
        insecure: Allow listening on a non-loopback address without a cluster key (anyone who
            can reach the port then controls the cluster).
        enable_fault_injection: Accept the ``fault`` command and the ``faults`` presets (tests
            and the harness). Off: both are refused (``forbidden``; a ``faults`` preset is a
            configuration error).
        allow_remote_operator: Accept the operator commands (``leave``, ``link``, ``fault``)
            over TCP from any cluster key holder, not only on the local IPC socket. Needs
            ``cluster_key``. Off (the default): a key holder that is not this daemon's user
            cannot make it leave or re-link.
        metrics_host: Address the metrics endpoint binds (``None``: loopback). Another than a
            loopback address needs ``cluster_key`` (the endpoint is plain HTTP; with a key every
            request must carry the bearer token ``chaos-daemon metrics-token`` prints).
        metrics_max_connections: Most connections the metrics endpoint holds open at once; more
            wait in the kernel's accept queue, holding no descriptor or thread of the daemon.
        metrics_idle_timeout_s: A metrics connection idle this long (no request in progress)
            is closed; whole seconds (the server counts in seconds).
        metrics_threads: Worker threads answering metrics requests (the endpoint's threads are
            these and one more, whatever the number of connections).
        max_peer_sockets: Most DEALER sockets to peers and join contacts open at once (the
            ZeroMQ context allows 1023 sockets in all). A peer beyond it is not connected: its
            frames are dropped and counted, like lost packets.
        max_measurements: Most link measurements in progress at once; a ``connect_command``
            beyond it is reported down at once.
        join_rate_per_s: Join requests accepted per second on average (a token bucket); more
            are refused (``overloaded``).
        join_burst: Join requests accepted at once before the rate applies.

    Raises:
        ConfigError: any value is invalid or the values are inconsistent.
    """

    node_id: str
    listen: str
    join: tuple[str, ...] = ()
    neighbors: tuple[str, ...] = ()
    heartbeat_interval_s: float = 0.5
    failure_timeout_s: float = 1.5
    election_timeout_min_s: float | None = None
    election_timeout_max_s: float | None = None
    link_probe_interval_s: float = 1.0
    link_failure_timeout_s: float = 3.0
    bandwidth_probe_bytes: int = 4 << 20
    bandwidth_probe_chunk_bytes: int = 256 << 10
    keep_probe_memory: bool = True
    probe_timeout_s: float = 5.0
    default_bandwidth_bps: float = 100e6
    sync_message_bytes: int = 100 << 20
    sync_switch_min_gain: float = 0.2
    per_shard_cost_s: float = 4e-6
    replication_strategy: str = "chaos"
    straggler_grace_s: float = 10.0
    behind_grace_s: float = 3.0
    offender_limit: int = 3
    offender_window_steps: int = 100
    join_timeout_s: float = 30.0
    op_timeout_s: float = 10.0
    leave_timeout_s: float = 5.0
    resource_interval_s: float = 5.0
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    metrics_port: int | None = None
    run_dir: str = field(default_factory=default_run_dir)
    ipc_endpoint: str | None = None
    event_log: str | None = None
    faults: tuple[str, ...] = ()
    cluster_key: str | None = None
    insecure: bool = False
    enable_fault_injection: bool = False
    allow_remote_operator: bool = False
    metrics_host: str | None = None
    max_peer_sockets: int = 512
    max_measurements: int = 64
    join_rate_per_s: float = 20.0
    join_burst: int = 64
    metrics_max_connections: int = 32
    metrics_idle_timeout_s: float = 10.0
    metrics_threads: int = 2

    def __post_init__(self) -> None:
        check_node_id(self.node_id)
        if self.replication_strategy not in REPLICATION_STRATEGIES:
            raise ConfigError(
                f"replication_strategy must be one of {', '.join(REPLICATION_STRATEGIES)}, "
                f"got {self.replication_strategy!r}"
            )
        check_tcp_endpoint(self.listen, "listen endpoint")
        self._check_join()
        if not isinstance(self.neighbors, tuple):
            raise ConfigError("neighbors must be a tuple of node ids")
        for n in self.neighbors:
            check_node_id(n, "neighbor id")
        if self.node_id in self.neighbors:
            raise ConfigError("a node cannot be its own neighbor")
        for name in (
            "heartbeat_interval_s",
            "failure_timeout_s",
            "link_probe_interval_s",
            "link_failure_timeout_s",
            "probe_timeout_s",
            "default_bandwidth_bps",
            "per_shard_cost_s",
            "join_timeout_s",
            "op_timeout_s",
            "leave_timeout_s",
            "resource_interval_s",
            "join_rate_per_s",
        ):
            _positive(name, getattr(self, name))
        for name in ("election_timeout_min_s", "election_timeout_max_s"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        for name in (
            "bandwidth_probe_bytes",
            "bandwidth_probe_chunk_bytes",
            "sync_message_bytes",
            "max_frame_bytes",
            "max_peer_sockets",
            "max_measurements",
            "join_burst",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        g = self.sync_switch_min_gain
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0.0 <= g < 1.0:
            raise ConfigError(f"sync_switch_min_gain must be in [0, 1), got {g!r}")
        if not isinstance(self.keep_probe_memory, bool):
            v = self.keep_probe_memory
            raise ConfigError(f"keep_probe_memory must be true or false, got {v!r}")
        self._check_consistency()
        self._check_straggler_grace()
        self._check_offenders()

    def _check_join(self) -> None:
        if not isinstance(self.join, tuple):
            raise ConfigError(f"join must be a tuple of endpoints, got {self.join!r}")
        for j in self.join:
            check_tcp_endpoint(j, "join endpoint")
            if j == self.listen:
                raise ConfigError("--join must name other daemons, not this one's --listen")
        if len(set(self.join)) != len(self.join):
            raise ConfigError(f"--join names an endpoint twice: {', '.join(self.join)}")

    def _check_offenders(self) -> None:
        lim, win = self.offender_limit, self.offender_window_steps
        if isinstance(lim, bool) or not isinstance(lim, int) or lim < 0:
            raise ConfigError(f"offender_limit must be an integer >= 0 (0: off), got {lim!r}")
        if isinstance(win, bool) or not isinstance(win, int) or win < 1:
            raise ConfigError(f"offender_window_steps must be a positive integer, got {win!r}")
        if lim > win:
            raise ConfigError(
                f"offender_limit ({lim}) cannot exceed offender_window_steps ({win}): a device "
                "offends at most once per step"
            )

    def _check_straggler_grace(self) -> None:
        for name in ("straggler_grace_s", "behind_grace_s"):
            g = getattr(self, name)
            if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g):
                raise ConfigError(f"{name} must be a finite number, got {g!r}")
            if g != 0 and g <= 2 * self.heartbeat_interval_s:
                raise ConfigError(
                    f"{name} ({g}) must be 0 (off) or exceed twice heartbeat_interval_s "
                    f"({self.heartbeat_interval_s}): the trainers' progress reaches the "
                    "scheduler once per heartbeat interval"
                )

    def _check_consistency(self) -> None:
        if self.failure_timeout_s <= 2 * self.heartbeat_interval_s:
            raise ConfigError(
                f"failure_timeout_s ({self.failure_timeout_s}) must exceed twice "
                f"heartbeat_interval_s ({self.heartbeat_interval_s})"
            )
        lo, hi = self.election_timeout_range_s
        if lo < self.failure_timeout_s or hi < lo:
            raise ConfigError(
                f"election timeouts must satisfy failure_timeout_s <= min <= max, got {lo}, {hi}"
            )
        if self.link_failure_timeout_s <= self.failure_timeout_s:
            raise ConfigError("link_failure_timeout_s must exceed failure_timeout_s")
        if self.bandwidth_probe_chunk_bytes + 4096 > self.max_frame_bytes:
            raise ConfigError("bandwidth_probe_chunk_bytes must fit max_frame_bytes - 4096")
        if self.max_frame_bytes < 16 << 10:
            raise ConfigError("max_frame_bytes must be at least 16 KiB")
        if self.metrics_port is not None and (
            isinstance(self.metrics_port, bool)
            or not isinstance(self.metrics_port, int)
            or not 1 <= self.metrics_port <= 65535
        ):
            raise ConfigError(f"metrics_port must be in 1..65535, got {self.metrics_port!r}")
        if self.ipc_endpoint is not None and not self.ipc_endpoint.startswith("ipc://"):
            raise ConfigError(f"ipc_endpoint must start with ipc://, got {self.ipc_endpoint!r}")
        if self.ipc_endpoint is not None and (
            len(self.ipc_endpoint.removeprefix("ipc://").encode()) > IPC_PATH_MAX
        ):
            raise ConfigError(
                f"ipc_endpoint path is longer than {IPC_PATH_MAX} bytes (the unix socket limit): "
                f"{self.ipc_endpoint!r}"
            )
        for f in self.faults:
            _parse_fault_spec(f)
        if self.max_peer_sockets > MAX_PEER_SOCKETS:
            raise ConfigError(
                f"max_peer_sockets must be at most {MAX_PEER_SOCKETS} (the daemon's own sockets "
                f"share ZeroMQ's limit of 1023), got {self.max_peer_sockets}"
            )
        if self.metrics_host is not None and (
            not isinstance(self.metrics_host, str) or not self.metrics_host
        ):
            raise ConfigError(f"metrics_host must be a host name or address, got "
                              f"{self.metrics_host!r}")  # fmt: skip
        self._check_metrics()
        self._check_security()

    def _check_metrics(self) -> None:
        for name, most in (("metrics_max_connections", 1024), ("metrics_threads", 64)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= most:
                raise ConfigError(f"{name} must be an integer in 1..{most}, got {v!r}")
        t = self.metrics_idle_timeout_s
        _positive("metrics_idle_timeout_s", t)
        if t != int(t):
            raise ConfigError(
                f"metrics_idle_timeout_s must be a whole number of seconds (the metrics server "
                f"counts idle time in seconds), got {t!r}"
            )

    def _check_security(self) -> None:
        for name in ("insecure", "enable_fault_injection", "allow_remote_operator"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.allow_remote_operator and self.cluster_key is None:
            raise ConfigError(
                "allow_remote_operator (--allow-remote-operator) needs a cluster key: without "
                "one any local user could make this daemon leave or re-link over TCP"
            )
        if self.faults and not self.enable_fault_injection:
            raise ConfigError(
                "fault presets (faults / --fault) need enable_fault_injection "
                "(--enable-fault-injection): faults are for tests and the harness only"
            )
        if self.cluster_key is not None:
            ClusterKey.load(self.cluster_key)  # raises ConfigError with the reason
            return
        host = self.resolved_metrics_host
        if self.metrics_port is not None and not is_loopback_endpoint(f"tcp://[{host}]:1"):
            raise ConfigError(
                f"refusing to serve metrics on {host} without a cluster key: the endpoint is "
                "plain, unauthenticated HTTP. Leave --metrics-host out (metrics then bind "
                "loopback) or run keyed daemons (--cluster-key FILE)"
            )
        if not self.insecure and not is_loopback_endpoint(self.listen):
            raise ConfigError(
                f"refusing to listen on {self.listen} without a cluster key: anyone who can "
                "reach it could control the cluster. Pass --cluster-key FILE (create one with "
                "'chaos-daemon keygen FILE'), listen on 127.0.0.1, or pass --insecure"
            )

    @property
    def election_timeout_range_s(self) -> tuple[float, float]:
        """The randomized election timeout range ``(min, max)`` in seconds."""
        lo = self.election_timeout_min_s
        if lo is None:
            lo = self.failure_timeout_s
        hi = self.election_timeout_max_s
        if hi is None:
            hi = max(lo, 2 * self.failure_timeout_s)
        return lo, hi

    @property
    def scheduler_stickiness_s(self) -> float:
        """A member that heard its scheduler this recently denies votes (Raft section 6)."""
        return 2 * self.heartbeat_interval_s

    @property
    def resolved_ipc_endpoint(self) -> str:
        """The IPC endpoint actually bound."""
        return self.ipc_endpoint or ipc_endpoint_for(self.run_dir)

    @property
    def resolved_metrics_host(self) -> str:
        """The address the metrics endpoint binds: ``metrics_host``, else loopback (``::1``
        for an IPv6 listen address, else ``127.0.0.1``), whatever the listen host."""
        if self.metrics_host is not None:
            return self.metrics_host
        host = self.listen.removeprefix("tcp://").rsplit(":", 1)[0]
        return "::1" if host.startswith("[") else "127.0.0.1"

    @property
    def resolved_event_log(self) -> str:
        """The event log path actually written."""
        return self.event_log or str(Path(self.run_dir) / f"events-{self.node_id}.jsonl")


#: Most peer DEALERs :attr:`DaemonConfig.max_peer_sockets` may allow (ZeroMQ's default limit of
#: 1023 sockets per context, less room for the daemon's own ROUTERs, monitors and notifier).
MAX_PEER_SOCKETS = 960


def ensure_private_run_dir(path: str | os.PathLike[str]) -> Path:
    """Creates the run directory with mode 0700, or checks that an existing one is private.

    The run directory holds the IPC socket, through which any local process that can reach it
    controls the daemon, and the event log. It must be a directory owned by this user with no
    group or other permission bits.

    Args:
        path: The run directory.

    Returns:
        The directory.

    Raises:
        ConfigError: it cannot be created, is not a directory, belongs to another user, or is
            open to the group or to others.
    """
    p = Path(path)
    try:
        try:
            p.mkdir(mode=0o700, parents=True, exist_ok=True)
        except FileExistsError:
            pass  # not a directory: said below
        st = os.lstat(p)
    except OSError as exc:
        raise ConfigError(f"cannot create the run directory {p}: {exc.strerror}") from exc
    if stat.S_ISLNK(st.st_mode):
        try:
            st = os.stat(p)
        except OSError as exc:
            raise ConfigError(f"run directory {p} is a dangling symlink") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"run directory {p} is not a directory")
    if st.st_uid != os.geteuid():
        raise ConfigError(
            f"run directory {p} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}): "
            "another user could control the daemon through it; choose another CHAOS_DAEMON_DIR"
        )
    if st.st_mode & 0o077:
        mode = stat.S_IMODE(st.st_mode)
        raise ConfigError(
            f"run directory {p} is open to other users (mode {mode:o}): they could control the "
            f"daemon through its IPC socket; run 'chmod 700 {p}'"
        )
    return p


#: Longest path a unix socket address can hold (``sizeof(sockaddr_un.sun_path) - 1`` on Linux).
IPC_PATH_MAX = 107


def ipc_endpoint_for(run_dir: str) -> str:
    """The default IPC endpoint of the daemon whose run directory is ``run_dir``.

    It is ``ipc://<run_dir>/daemon.ipc`` when that fits in a unix socket address. A deeper run
    directory (pytest's temporary folders, an emulation's device folders) gets a short path in
    the system temporary directory derived from the run directory, so the daemon and every
    client that knows the run directory still agree on it.
    """
    path = str(Path(run_dir) / "daemon.ipc")
    if len(path.encode()) <= IPC_PATH_MAX:
        return f"ipc://{path}"
    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:20]
    return f"ipc://{Path(tempfile.gettempdir()) / f'chaos-{digest}.ipc'}"


def _parse_fault_spec(spec: str) -> tuple[str, list[str]]:
    name, _, rest = spec.partition(":")
    if name not in ("drop_to", "drop_from", "cut_link", "partition"):
        raise ConfigError(f"unknown fault {name!r} in {spec!r}")
    peers = [p for p in rest.split(",") if p]
    for p in peers:
        check_node_id(p, "fault peer id")
    return name, peers


def parse_fault_spec(spec: str) -> tuple[str, list[str]]:
    """Parses ``NAME:PEER,PEER`` (e.g. ``cut_link:n2``).

    Args:
        spec: The fault spec.

    Returns:
        The fault name and its peers.

    Raises:
        ConfigError: unknown fault or bad peer id.
    """
    return _parse_fault_spec(spec)


def parse_join_endpoints(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """The join endpoints of ``--join`` (repeatable) or the ``join`` key: each value may list
    several endpoints separated by commas.

    Args:
        value: One string, several, or ``None``.

    Returns:
        The endpoints in order, blanks dropped (checked by :class:`DaemonConfig`).

    Raises:
        ConfigError: a value is not a string.
    """
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else list(value)
    out: list[str] = []
    for v in values:
        if not isinstance(v, str):
            raise ConfigError(f"join endpoints must be strings, got {v!r}")
        out += [p.strip() for p in v.split(",") if p.strip()]
    return tuple(out)


_TUPLE_FIELDS = {"neighbors", "faults"}
_FIELDS = {f.name for f in dataclasses.fields(DaemonConfig)}


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Reads a daemon TOML file (flat keys, or under a ``[daemon]`` table).

    Args:
        path: The file.

    Returns:
        The settings it holds, keyed by :class:`DaemonConfig` field name.

    Raises:
        ConfigError: unreadable file, bad TOML, or an unknown key.
    """
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"bad TOML in {path}: {exc}") from exc
    if isinstance(data.get("daemon"), dict):
        data = data["daemon"]
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise ConfigError(f"unknown key(s) in {path}: {', '.join(unknown)}")
    if "join" in data:
        data["join"] = parse_join_endpoints(data["join"])
    return {
        k: (tuple(v) if k in _TUPLE_FIELDS and isinstance(v, list) else v) for k, v in data.items()
    }


def load_config(cli: Mapping[str, Any], file: str | os.PathLike[str] | None = None) -> DaemonConfig:
    """Merges the layers: CLI values (``None`` means unset) over the file over the defaults.

    Args:
        cli: Settings from the command line, keyed by field name.
        file: Optional TOML file.

    Returns:
        The validated config.

    Raises:
        ConfigError: bad file, unknown key, or invalid/missing values.
    """
    merged: dict[str, Any] = read_toml(file) if file is not None else {}
    for key, value in cli.items():
        if key not in _FIELDS:
            raise ConfigError(f"unknown setting {key!r}")
        if value is not None and value != ():
            merged[key] = value
    for required in ("node_id", "listen"):
        if required not in merged:
            raise ConfigError(f"missing required setting {required!r} (flag or config file)")
    try:
        return DaemonConfig(**merged)
    except TypeError as exc:
        raise ConfigError(str(exc)) from exc
