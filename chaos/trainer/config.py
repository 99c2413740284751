"""The Trainer's configuration: :class:`TrainerConfig`, one frozen dataclass checked when it is
made, and the checks of the values a script passes to the Trainer besides it."""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Any

from chaos.errors import ConfigError
from chaos.security import ClusterKey

__all__ = [
    "MAX_GLOBAL_BATCH",
    "TrainerConfig",
    "check_data_ports",
    "check_extra_state",
    "check_num_samples",
    "resolve_host",
]

LOOPBACK = "127.0.0.1"
"""The data-plane host of a trainer that has no network address to go by."""

MAX_GLOBAL_BATCH = 1 << 31
"""The largest ``TrainerConfig.global_batch``."""


class NonFiniteMode(str, enum.Enum):
    """What a member does with a step whose gradients are not finite
    (:attr:`TrainerConfig.nonfinite`; see :mod:`chaos.trainer.finite`).

    ``SKIP``: every member skips the step alike (no optimizer step, no hook; :attr:`Trainer.step`
    still counts it) and emits ``nonfinite_gradient``. ``RAISE``: every member raises
    :class:`~chaos.errors.NonFiniteGradient` in that ``update()``. ``OFF``: no check.
    """

    SKIP = "skip"
    RAISE = "raise"
    OFF = "off"


def check_nonfinite(cfg: TrainerConfig) -> None:
    """Sets ``cfg.nonfinite`` to its :class:`NonFiniteMode` and checks ``max_grad_norm``.

    Raises:
        ConfigError: an unknown mode, or a bound that is not a positive finite number.
    """
    try:
        mode = NonFiniteMode(cfg.nonfinite)
    except ValueError:
        values = ", ".join(m.value for m in NonFiniteMode)
        raise ConfigError(f"nonfinite must be one of {values}, got {cfg.nonfinite!r}") from None
    object.__setattr__(cfg, "nonfinite", mode)  # frozen: the one normalisation of the value
    mn = cfg.max_grad_norm
    if mn is not None and (isinstance(mn, bool) or not isinstance(mn, (int, float))
                           or not 0 < mn < float("inf")):  # fmt: skip
        raise ConfigError(f"max_grad_norm must be None or a positive finite number, got {mn!r}")


@dataclass(frozen=True)
class TrainerConfig:
    """Options of a :class:`Trainer` (the ``**options`` of its constructor).

    Args:
        host: The address the data-plane endpoints (the allreduce endpoint, the shard server)
            bind to and advertise to the other members, so one they reach. ``None`` (the
            default): the address of the embedded daemon's ``listen`` endpoint when the
            Trainer is given one, else ``127.0.0.1`` (see :func:`resolve_host`). A loopback
            host with a ``listen`` or ``join`` address on another interface is refused: the
            other devices could not reach the state or the gradients.
        step_timeout_s: Longest wait for the next allreduce frame before the neighbour is
            declared failed. Raise it when a step's compute time varies a lot between devices.
        policy_timeout_s: Longest silence of the local daemon that a step boundary tolerates
            (it answers policy requests; a busy device may answer late). It must exceed the
            daemon's failure timeout (1.5 s by default).
        stall_timeout_s: Longest time a step may wait for the cluster to heal after its
            allreduce failed or was interrupted: a failure detected and scaled in, a split
            overlay being reconnected, a partition that pauses this side until it heals. The
            wait is reported every ``stall_progress_s`` (event ``waiting``, and a log line).
            ``None`` (the default): wait as long as it takes; a cluster that can heal is never
            given up on. Set it when a script must give up on its own, and catch
            :class:`TrainingStalled`.
        stall_progress_s: How often a waiting step reports that it still waits.
        join_timeout_s: Longest wait for the daemon to join and the scheduler to plan the join.
            An embedded daemon tries its join contacts (again and again: some may be cut off
            or paused for a while) for as long, as its ``--join-timeout``.
        join_queue_timeout_s: Longest time a joiner waits in line while the scheduler admits
            other joiners one at a time (its registration or ``caught_up`` refused
            ``overloaded``: another joiner is catching up or entering); this time does not
            count against ``join_timeout_s``. Raise it when many devices join at once with a
            large state; ``None``: wait as long as it takes.
        replication_timeout_s: Limit on pulling the whole state when joining.
        poll_interval_s: How often the trainer asks its daemon for a newer policy while blocked
            in an allreduce. Lower reacts faster to membership changes, at a small CPU cost.
        chunk_bytes: Allreduce frame size; see :class:`CommunicatorConfig`.
        wire_dtype: ``None``, ``"float16"``, ``"bfloat16"`` or ``"int8"`` gradient wire
            format (int8: blockwise with error feedback, the sample count and audit exact).
        lanes: Send the gradient chunks over plain TCP payload lanes beside ZeroMQ (faster:
            no copy out of ZeroMQ's buffers); turn it off where only the data endpoint's port
            may be opened between devices. See :attr:`CommunicatorConfig.lanes`.
        data_ports: ``(first, last)``, an inclusive range of TCP ports for the trainer's data
            endpoints (the allreduce endpoint and the shard server bind its first two free
            ports; ports other programs hold are skipped). Set it where ephemeral ports could
            collide with ports chosen for other listeners, or where only known ports may be
            opened between devices (then also set ``lanes=False``: the payload lanes use an
            ephemeral port). ``None``: ephemeral ports.
        daemon_args: Extra ``chaos-daemon start`` arguments for the embedded daemon.
        daemon_dir: The embedded daemon's run directory (IPC socket, event log); default: a
            fresh temporary directory.
        pull_window: Outstanding shard requests per donor while joining.
        pull_progress_s: Seconds between two log lines of a joiner's state pull (bytes of the
            total, rate, donors) when stderr is not a terminal; on a terminal the pull shows a
            progress bar instead.
        policy_notices: Learn of newer policies from the daemon's published notices, asking the
            daemon only when one names a newer epoch (or the notices fall silent). ``False``:
            ask at every step boundary (an IPC round trip each), as a comparison baseline.
        restored: The model and optimizer were loaded from a checkpoint that every member
            restores (the stop-resume baseline): the trainer joins with that state instead of
            pulling one; the scheduler admits it only if its state digest equals the first
            trainer's. Such members should not step until all of them are in (see
            :meth:`Trainer.wait_world`).
        cluster_key: The cluster key file (``chaos-daemon keygen FILE``, mode 0600): the data
            plane (allreduce endpoint, payload lanes, shard server, pulls) and a TCP connection
            to the daemon are then authenticated and encrypted, and the embedded daemon starts
            with ``--cluster-key``. ``None``: no key (plain sockets; see ``docs/security.md``).
        global_batch: Samples per step over the whole cluster, kept constant as members come
            and go: the scheduler splits it across the members in proportion to their measured
            throughput, and :attr:`Trainer.local_batch_size` says this member's part. Every
            member must set the same value, and pass ``num_samples`` to ``update()``. ``None``
            (the default): off, each script picks its own batch.
        join_mode: How a joiner gets the state. ``"catch-up"`` (the default): the members
            train on while it pulls a snapshot from its donors; in its first ``update()`` it
            replays the steps it missed from the donors' step logs (the averaged gradients and
            the hyperparameters of each step), then enters the allreduce at a step boundary,
            pulling only what still differs from the members' state (see ``docs/state.md``).
            ``"barrier"``: it enters the data plane at once and every member waits at its next
            allreduce until the joiner has pulled the state. The scheduler falls back to a
            barrier join while it has not measured the donors' step period.
        catch_up_log_bytes: Most gradient bytes a donor logs for a catching-up joiner (one
            step logs about the model's size). A joiner that is still behind when a donor's log
            is full enters and pulls what differs, as in a barrier join. Raise it for slow
            joiner links with fast steps; lower it where memory is short.
        catch_up_timeout_s: Longest time a joiner spends replaying before it asks to enter
            whatever its lag (it then pulls what differs).
        audit_every: Every this many steps the members compare digests of their state
            (parameters, optimizer state, extra state) inside the step's allreduce; a member
            whose digest differs from the others' emits ``state_diverged`` and pulls the
            state again, only the chunks that differ (``docs/state.md``). ``0``: no audit.
            Every member must use the same value. The default keeps the audit under 1% of
            the step time for the docs' models (``chaos-bench audit``); lower it to find a
            divergence sooner, raise it for a large state with a short step.
        nonfinite: What a step whose gradients are not finite does (:class:`NonFiniteMode`
            or its value): ``"skip"`` (the default) every member skips it alike and emits
            ``nonfinite_gradient`` naming the device; ``"raise"`` every member raises
            :class:`~chaos.errors.NonFiniteGradient`; ``"off"`` no check. Use ``"off"`` with a
            ``torch.amp.GradScaler``, which skips such steps and lowers its scale itself.
            Every member must use the same value.
        max_grad_norm: With ``nonfinite`` on, a local gradient whose L2 norm exceeds this
            counts as bad too (an exploding gradient that would overflow the optimizer's
            state). ``None`` (the default): finiteness only.
        max_early_bytes: Most bytes of allreduce frames the data plane keeps for a later
            round (a neighbour a step or an epoch ahead; see
            :attr:`CommunicatorConfig.max_early_bytes`); beyond it they are dropped and
            counted. It bounds the memory anyone with the cluster key can pin on this trainer
            that way. ``None`` (the default): four times the model's gradient in float32, at
            least 256 MiB.

    Raises:
        ConfigError: a non-positive timeout or interval, a bad ``data_ports`` range, or a
            cluster key file that is missing, readable by others or not a key.
    """

    host: str | None = None
    step_timeout_s: float = 30.0
    policy_timeout_s: float = 10.0
    stall_timeout_s: float | None = None
    stall_progress_s: float = 10.0
    join_timeout_s: float = 60.0
    join_queue_timeout_s: float | None = 600.0
    replication_timeout_s: float = 600.0
    poll_interval_s: float = 0.02
    chunk_bytes: int = 1 << 20
    wire_dtype: str | None = None
    lanes: bool = True
    data_ports: tuple[int, int] | None = None
    daemon_args: tuple[str, ...] = ()
    daemon_dir: str | None = None
    pull_window: int = 8
    pull_progress_s: float = 5.0
    policy_notices: bool = True
    restored: bool = False
    cluster_key: str | None = None
    global_batch: int | None = None
    join_mode: str = "catch-up"
    catch_up_log_bytes: int = 1 << 30
    catch_up_timeout_s: float = 120.0
    audit_every: int = 200
    nonfinite: NonFiniteMode = NonFiniteMode.SKIP
    max_grad_norm: float | None = None
    max_early_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.host is not None:
            check_host(self.host)
        for name in (
            "step_timeout_s",
            "policy_timeout_s",
            "join_timeout_s",
            "replication_timeout_s",
            "poll_interval_s",
            "stall_progress_s",
            "catch_up_timeout_s",
            "pull_progress_s",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        for name in ("stall_timeout_s", "join_queue_timeout_s"):
            st = getattr(self, name)
            if st is not None and (isinstance(st, bool) or not isinstance(st, (int, float))
                                   or not st > 0):  # fmt: skip
                raise ConfigError(f"{name} must be None or a positive number, got {st!r}")
        if not isinstance(self.daemon_args, tuple):
            raise ConfigError("daemon_args must be a tuple of strings")
        check_data_ports(self.data_ports)
        if self.join_mode not in JOIN_MODES:
            raise ConfigError(f"join_mode must be one of {', '.join(JOIN_MODES)}, "
                              f"got {self.join_mode!r}")  # fmt: skip
        ae = self.audit_every
        if isinstance(ae, bool) or not isinstance(ae, int) or ae < 0:
            raise ConfigError(f"audit_every must be an int >= 0 (0: no audit), got {ae!r}")
        check_nonfinite(self)
        lb = self.catch_up_log_bytes
        if isinstance(lb, bool) or not isinstance(lb, int) or lb < 0:
            raise ConfigError(f"catch_up_log_bytes must be an int >= 0, got {lb!r}")
        eb = self.max_early_bytes
        if eb is not None and (isinstance(eb, bool) or not isinstance(eb, int) or eb < 0):
            raise ConfigError(f"max_early_bytes must be None or an int >= 0, got {eb!r}")
        gb = self.global_batch
        if gb is not None and (isinstance(gb, bool) or not isinstance(gb, int)
                               or not 1 <= gb <= MAX_GLOBAL_BATCH):  # fmt: skip
            raise ConfigError(
                f"global_batch must be None or an int in 1..{MAX_GLOBAL_BATCH}, got {gb!r}"
            )
        if self.cluster_key is not None:
            if not isinstance(self.cluster_key, (str, os.PathLike)):
                raise ConfigError(f"cluster_key must be a file path, got {self.cluster_key!r}")
            ClusterKey.load(self.cluster_key)  # a ConfigError that says what is wrong with it


    @property
    def data_host(self) -> str:
        """:attr:`host`, once :func:`resolve_host` set it.

        Raises:
            ConfigError: it is still ``None`` (the config was not resolved).
        """
        if self.host is None:
            raise ConfigError("TrainerConfig.host is not resolved: use resolve_host()")
        return self.host


JOIN_MODES = ("catch-up", "barrier")
"""Values of :attr:`TrainerConfig.join_mode`."""



def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as an IP address (``localhost`` as loopback), ``None`` for another name."""
    if host == "localhost":
        return ipaddress.ip_address(LOOPBACK)
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def check_host(host: object) -> None:
    """Raises ConfigError unless ``host`` is an address that can be advertised: a non-empty
    string, not a wildcard (``0.0.0.0``, ``::``: peers cannot connect to it)."""
    if not isinstance(host, str) or not host or "/" in host or " " in host:
        raise ConfigError(f"host must be an interface address or name, got {host!r}")
    ip = _ip(host)
    if ip is not None and ip.is_unspecified:
        raise ConfigError(
            f"host {host!r} is a wildcard address, which the other members cannot connect to: "
            "set host to this device's address on the network the members share"
        )


def _endpoint_host(endpoint: str) -> str:
    """The host of a checked ``tcp://HOST:PORT`` endpoint."""
    return endpoint[len("tcp://"):].rsplit(":", 1)[0]


def resolve_host(cfg: TrainerConfig, listen: str | None, join: str | None) -> TrainerConfig:
    """``cfg`` with its data-plane :attr:`~TrainerConfig.host` set: the one place where its
    default is chosen.

    A ``host`` left ``None`` becomes the address of the embedded daemon's ``listen`` endpoint
    (``tcp://ADDR:PORT``), or :data:`LOOPBACK` without one. A loopback host is then refused
    when the trainer talks to other devices: its ``listen`` or ``join`` address is not
    loopback (the members there would be told a data-plane address of their own loopback).

    Args:
        cfg: The config as the script gave it.
        listen: The embedded daemon's control endpoint, if given (checked).
        join: The member endpoint to join through, if any (checked).

    Returns:
        The config with ``host`` set.

    Raises:
        ConfigError: a loopback host with a non-loopback ``listen`` or ``join``, or a
            ``listen`` on a wildcard address without a ``host``.
    """
    host = cfg.host
    if host is None:
        host = _endpoint_host(listen) if listen is not None else LOOPBACK
        if (ip := _ip(host)) is not None and ip.is_unspecified:
            raise ConfigError(
                f"listen={listen!r} listens on every interface, so it names no address to "
                "advertise the data plane at: set the TrainerConfig option host to this "
                "device's address on the network the members share"
            )
    ip = _ip(host)
    if ip is not None and ip.is_loopback:
        for what, endpoint in (("listen", listen), ("join", join)):
            if endpoint is None:
                continue
            other = _ip(_endpoint_host(endpoint))
            if other is None or not (other.is_loopback or other.is_unspecified):
                raise ConfigError(
                    f"the data plane would be advertised at loopback {host} while {what}="
                    f"{endpoint!r} is on the network: the members on other devices could not "
                    "reach this trainer's state or gradients. Pass listen=\"tcp://ADDRESS:PORT\" "
                    "with this device's address (the data plane then uses it), or set the "
                    "TrainerConfig option host to it"
                )
    return cfg if host == cfg.host else dataclasses.replace(cfg, host=host)


def check_data_ports(ports: object) -> None:
    """Raises ConfigError unless ``ports`` is ``None`` or ``(first, last)`` with at least two
    ports within 1..65535."""
    if ports is None:
        return
    ok = (
        isinstance(ports, tuple)
        and len(ports) == 2
        and all(isinstance(p, int) and not isinstance(p, bool) for p in ports)
    )
    if not ok or not 1 <= ports[0] < ports[1] <= 65535:  # type: ignore[index]
        raise ConfigError(
            "data_ports must be None or (first, last) with 1 <= first < last <= 65535 "
            f"(two ports at least: the allreduce endpoint and the shard server), got {ports!r}"
        )


def check_extra_state(extra: object) -> dict[str, Any]:
    """``extra`` as a dict of named objects with ``state_dict`` and ``load_state_dict``.

    Raises:
        ConfigError: ``extra`` is not such a dict.
    """
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise ConfigError(f"extra_state must be a dict of named objects, got {extra!r}")
    for name, obj in extra.items():
        if not isinstance(name, str) or not 1 <= len(name) <= 256:
            raise ConfigError(f"extra_state names must be 1-256 characters, got {name!r}")
        for method in ("state_dict", "load_state_dict"):
            if not callable(getattr(obj, method, None)):
                raise ConfigError(f"extra_state[{name!r}] has no {method}() method")
    return dict(extra)


def check_num_samples(num_samples: object) -> None:
    """Raises TypeError or ValueError unless ``num_samples`` is ``None`` or an int >= 0 (0: the
    member takes part in the step but contributes nothing)."""
    if num_samples is None:
        return
    if isinstance(num_samples, bool) or not isinstance(num_samples, int):
        raise TypeError(f"num_samples must be an int or None, got {type(num_samples).__name__}")
    if num_samples < 0:
        raise ValueError(f"num_samples must be at least 0, got {num_samples}")


def default_node_id() -> str:
    """``HOSTNAME-PID``, with the characters a node id cannot hold replaced and the host name
    cut so that the id stays within 64 characters."""
    from chaos.protocol.ids import node_id_from

    host = node_id_from(socket.gethostname(), max_len=48)
    return f"{host}-{os.getpid()}"


def check_endpoints(
    join: str | None, daemon: str | None, node_id: str | None, listen: str | None
) -> None:
    """Rejects malformed endpoints and node ids before a daemon is started or dialled.

    Raises:
        ConfigError: one of them is malformed.
    """
    from chaos.protocol.ids import check_daemon_endpoint, check_node_id, check_tcp_endpoint

    if node_id is not None:
        check_node_id(node_id)
    if join is not None:
        check_tcp_endpoint(join, "join endpoint")
    if listen is not None:
        check_tcp_endpoint(listen, "listen endpoint")
    if daemon is not None:
        check_daemon_endpoint(daemon)
