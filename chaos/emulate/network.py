"""The emulated edge network: one network namespace per device, one shaped veth pair per link.

Layout (built by :class:`Network`, torn down on exit, on exceptions and on SIGINT/SIGTERM):

- **Namespaces.** Device ``i`` of a run lives in namespace ``<prefix><pid>-<run>-<i>`` (default
  prefix ``chaos-``), so parallel runs never collide and leftovers of a crashed run name the dead
  process (:func:`cleanup_stale` removes them).
- **Addresses.** Each device has a *node address* ``10.255.x.y/32`` on its loopback
  (:meth:`Network.address`); daemons bind to it and peers reach it from anywhere in the overlay.
  Each overlay link is a veth pair on its own /30 in ``10.0.0.0/10``; its ends are ``to-<j>``
  inside device ``i``'s namespace (the veth towards device ``j``).
- **Shaping.** Both ends of every veth carry a ``tbf`` root qdisc at the link's rate. tbf rather
  than htb: one rate per interface is all a link needs, tbf does it with one qdisc and no
  classifier, and it measured accurate here (``chaos-emulate links``). The rate counts whole
  Ethernet frames (1514 bytes for a 1448-byte TCP segment), so TCP goodput is about 95.6% of it.
- **Routing.** IP forwarding is on in every namespace and each device has a /32 route to every
  other node address along the shortest path over the links that are up (hop count, networkx),
  so non-neighbours are reached multi-hop over shaped links. Routes are recomputed by
  :meth:`Network.add_link`, :meth:`Network.remove_link`, :meth:`Network.cut_link` and
  :meth:`Network.restore_link`, as a routed network's routing protocol would after a link
  failure: traffic between two devices still connected through other links takes another path,
  and a device with no path left to another has no route to it.
- **Latency.** ``latency_s`` is the one-way delay of every link. Where the kernel has ``netem``,
  it sits above tbf on each veth end. Otherwise a delay relay
  (:mod:`chaos.emulate.relay`) runs in each namespace on a TUN device ``dly``: node-address routes
  point into ``dly``, the relay hands each packet back ``latency_s`` later, and a policy rule
  (``iif dly lookup 100``) forwards it out of the real veth. Each hop adds ``latency_s``.
- **Cuts.** :meth:`Network.cut_link` replaces both ends' root qdisc with ``blackhole``, which
  silently drops every packet, and routes around the link; the veths and addresses stay, so both
  devices stay up, and what was in flight on the link, or has no other path, is lost.

The harness lives in ``chaos/emulate/`` because it is a user-facing tool that drives daemons and
trainers from outside; nothing in the library imports it.
"""

from __future__ import annotations

import atexit
import itertools
import math
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import Any, Literal

import networkx as nx

from chaos.emulate.netns import (
    DEFAULT_COMMAND_TIMEOUT_S,
    NetworkSetupError,
    RootRequiredError,
    ip_batch,
    list_namespaces,
    namespace_pids,
    require_root,
    run_cmd,
)
from chaos.errors import ChaosTimeout

__all__ = [
    "LinkSpec",
    "Network",
    "NetworkConfig",
    "NetworkSetupError",
    "RootRequiredError",
    "cleanup_stale",
    "kernel_has_netem",
]

LatencyMethod = Literal["auto", "netem", "relay"]
RELAY_DEV = "dly"
RELAY_TABLE = 100
MAX_NODES = 4096
MAX_BANDWIDTH_BPS = 100e9
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9-]{0,23}$")
_run_counter = itertools.count()


@dataclass(frozen=True)
class LinkSpec:
    """One overlay link.

    Args:
        a: One end's node name.
        b: The other end's node name.
        bandwidth_bps: The link's rate in bits per second, applied on both ends (each direction).
    """

    a: str
    b: str
    bandwidth_bps: float

    def __post_init__(self) -> None:
        if not isinstance(self.a, str) or not isinstance(self.b, str):
            raise TypeError(f"link ends must be node names (str), got {self.a!r}, {self.b!r}")
        if self.a == self.b:
            raise ValueError(f"link {self.a!r}-{self.b!r} connects a node to itself")
        _check_bandwidth(self.bandwidth_bps)

    @property
    def key(self) -> tuple[str, str]:
        """The link's end names, sorted: the same for ``(a, b)`` and ``(b, a)``."""
        return _key(self.a, self.b)


@dataclass(frozen=True)
class NetworkConfig:
    """What :class:`Network` builds.

    Args:
        nodes: Device names, unique; device ``i`` gets namespace ``...-i``.
        links: The overlay's links (at most one per pair of devices).
        latency_s: One-way delay added by every link, seconds (0: none). Each hop adds it.
        latency_method: ``"netem"`` (fails where the kernel lacks it), ``"relay"`` (the TUN delay
            relay) or ``"auto"`` (netem if the kernel has it, else the relay).
        burst_s: tbf bucket size as seconds of the link's rate (at least two full frames). Larger
            bursts let short transfers overshoot the rate; smaller ones cost CPU in timer wake-ups.
        queue_s: tbf queue limit as seconds of the link's rate. Raise it for high latency links
            so that TCP can fill the pipe (about the path's round-trip time).
        mtu: MTU of the veth pairs and the relay device.
        prefix: Namespace name prefix; names are ``<prefix><pid>-<run>-<i>``.
        command_timeout_s: Timeout of each ``ip``/``tc`` invocation.
        relay_ready_timeout_s: How long a relay may take to start.
        handle_signals: Install SIGINT/SIGTERM handlers (main thread only) that tear the network
            down before the signal takes effect.
    """

    nodes: tuple[str, ...]
    links: tuple[LinkSpec, ...] = ()
    latency_s: float = 0.0
    latency_method: LatencyMethod = "auto"
    burst_s: float = 0.001
    queue_s: float = 0.05
    mtu: int = 1500
    prefix: str = "chaos-"
    command_timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S
    relay_ready_timeout_s: float = 10.0
    handle_signals: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, tuple) or not isinstance(self.links, tuple):
            raise TypeError("nodes and links must be tuples")
        if not 1 <= len(self.nodes) <= MAX_NODES:
            raise ValueError(f"need 1 to {MAX_NODES} nodes, got {len(self.nodes)}")
        for n in self.nodes:
            if not isinstance(n, str) or not n:
                raise ValueError(f"node names must be non-empty strings, got {n!r}")
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError(f"node names are not unique: {self.nodes}")
        seen: set[tuple[str, str]] = set()
        for link in self.links:
            if not isinstance(link, LinkSpec):
                raise TypeError(f"links must be LinkSpec, got {type(link).__name__}")
            for end in (link.a, link.b):
                if end not in self.nodes:
                    raise ValueError(f"link {link.a!r}-{link.b!r}: unknown node {end!r}")
            if link.key in seen:
                raise ValueError(f"duplicate link {link.a!r}-{link.b!r}")
            seen.add(link.key)
        _check_range("latency_s", self.latency_s, 0.0, 10.0)
        if self.latency_method not in ("auto", "netem", "relay"):
            raise ValueError(f"latency_method must be auto, netem or relay: {self.latency_method}")
        _check_range("burst_s", self.burst_s, 1e-6, 1.0, low_open=True)
        _check_range("queue_s", self.queue_s, 1e-4, 10.0)
        if not isinstance(self.mtu, int) or not 576 <= self.mtu <= 65535:
            raise ValueError(f"mtu must be an int in [576, 65535], got {self.mtu!r}")
        if not isinstance(self.prefix, str) or not _PREFIX_RE.match(self.prefix):
            raise ValueError(f"prefix must match {_PREFIX_RE.pattern}, got {self.prefix!r}")
        _check_range("command_timeout_s", self.command_timeout_s, 0.0, 600.0, low_open=True)
        _check_range("relay_ready_timeout_s", self.relay_ready_timeout_s, 0.0, 600.0,
                     low_open=True)  # fmt: skip


@dataclass
class _Link:
    a: str
    b: str
    subnet: int  # link serial number; its /30 is 10.0.0.0 + 4 * subnet
    bandwidth_bps: float
    cut: bool = False


@dataclass
class _SignalState:
    previous: dict[int, Any] = field(default_factory=dict)
    pending: int | None = None


class Network:
    """A running emulated network (a context manager; see the module docstring for the layout).

    Every method raises :class:`NetworkSetupError` if an ``ip``/``tc`` command fails and
    :class:`chaos.errors.ChaosTimeout` if one hangs past ``config.command_timeout_s``.

    Example::

        cfg = NetworkConfig(nodes=("a", "b", "c"),
                            links=(LinkSpec("a", "b", 100e6), LinkSpec("b", "c", 50e6)))
        with Network(cfg) as net:
            net.exec("a", ["ping", "-c1", net.address("c")])   # two hops, via b
    """

    def __init__(self, config: NetworkConfig) -> None:
        if not isinstance(config, NetworkConfig):
            raise TypeError(f"config must be a NetworkConfig, got {type(config).__name__}")
        self.config = config
        self.tag = f"{config.prefix}{os.getpid()}-{next(_run_counter)}"
        self._index = {n: i for i, n in enumerate(config.nodes)}
        self._links: dict[tuple[str, str], _Link] = {}
        self._subnets = itertools.count()
        self._created: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._routes: dict[str, dict[str, str]] = {n: {} for n in config.nodes}
        self._method: Literal["none", "netem", "relay"] = "none"
        self._lock = threading.RLock()
        self._signals = _SignalState()
        self._active = False
        self._closed = False

    # ----------------------------------------------------------------------------- lifecycle

    def __enter__(self) -> Network:
        require_root()
        if self._active or self._closed:
            raise NetworkSetupError("a Network can be entered only once")
        self._active = True
        self._install_signal_handlers()
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:  # fmt: skip
        self.close()

    def close(self) -> None:
        """Removes every process, namespace (and with it every veth, TUN and qdisc) of this run.

        Idempotent. Every namespace is attempted even if one fails. A SIGINT/SIGTERM arriving
        during teardown is held and re-raised (as KeyboardInterrupt / SystemExit) afterwards.

        Raises:
            NetworkSetupError: a namespace could not be deleted (named in the message).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        failed: list[str] = []
        try:
            for p in self._procs:
                _stop_process(p, timeout_s=2.0)
            for ns in self._created:  # each on its own: one failure must not leak the rest
                try:
                    for pid in namespace_pids(ns, self.config.command_timeout_s):
                        _kill_pid(pid)
                    run_cmd(["ip", "netns", "del", ns], timeout_s=self.config.command_timeout_s)
                except (ChaosTimeout, NetworkSetupError) as e:
                    failed.append(f"{ns}: {e}")
        finally:
            atexit.unregister(self.close)
            self._restore_signal_handlers()
        pending = self._signals.pending
        if failed and pending is None:
            raise NetworkSetupError("could not remove (try `chaos-emulate cleanup`): "
                                    + "; ".join(failed))  # fmt: skip
        if pending == signal.SIGINT:
            raise KeyboardInterrupt
        if pending is not None:
            raise SystemExit(128 + pending)

    def _install_signal_handlers(self) -> None:
        if not self.config.handle_signals:
            return
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, _frame: FrameType | None) -> None:
            if self._closed:
                self._signals.pending = signum  # tearing down: re-raised once done
                return
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)

        for sig in (signal.SIGINT, signal.SIGTERM):
            self._signals.previous[sig] = signal.signal(sig, handler)

    def _restore_signal_handlers(self) -> None:
        for sig, prev in self._signals.previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._signals.previous.clear()

    # ----------------------------------------------------------------------------- building

    def _build(self) -> None:
        cfg = self.config
        to = cfg.command_timeout_s
        if cfg.latency_s > 0:
            netem = cfg.latency_method == "netem" or (
                cfg.latency_method == "auto" and kernel_has_netem(cfg.prefix, to)
            )
            self._method = "netem" if netem else "relay"
        names = [self.ns(n) for n in cfg.nodes]
        for ns in names:  # one by one, so that a failure leaves exactly the created list
            run_cmd(["ip", "netns", "add", ns], timeout_s=to)
            self._created.append(ns)
        for node, ns in zip(cfg.nodes, names, strict=True):
            self._setup_node(node, ns)
        for spec in cfg.links:
            self._create_link(spec.a, spec.b, spec.bandwidth_bps)
        if self._method == "relay":
            for node in cfg.nodes:
                self._start_relay(node)
        self._update_routes()

    def _setup_node(self, node: str, ns: str) -> None:
        to = self.config.command_timeout_s
        cmds = ["link set lo up", f"address add {self.address(node)}/32 dev lo"]
        if self._method == "relay":
            cmds += [
                f"tuntap add dev {RELAY_DEV} mode tun",
                f"link set {RELAY_DEV} mtu {self.config.mtu} txqueuelen 10000 up",
                f"rule add iif {RELAY_DEV} lookup {RELAY_TABLE} pref 100",
            ]
        ip_batch(ns, cmds, timeout_s=to)
        sysctls = ["net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0",
                   "net.ipv4.conf.default.rp_filter=0"]  # fmt: skip
        if self._method == "relay":
            sysctls += [f"net.ipv4.conf.{RELAY_DEV}.rp_filter=0",
                        f"net.ipv4.conf.{RELAY_DEV}.accept_local=1"]  # fmt: skip
        run_cmd(["ip", "netns", "exec", ns, "sysctl", "-qw", *sysctls], timeout_s=to)

    def _start_relay(self, node: str) -> None:
        argv = [sys.executable, "-m", "chaos.emulate.relay", "--dev", RELAY_DEV,
                "--delay-s", repr(self.config.latency_s)]  # fmt: skip
        p = self.popen(node, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + self.config.relay_ready_timeout_s
        if p.stdout is None:  # pragma: no cover - stdout=PIPE always sets it
            raise NetworkSetupError("relay has no stdout")
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChaosTimeout(f"delay relay of {node!r} not ready within "
                                   f"{self.config.relay_ready_timeout_s} s")  # fmt: skip
            ready, _, _ = select.select([p.stdout], [], [], left)
            if ready:
                line = p.stdout.readline()
                if line.strip() == "ready":
                    return
                err = p.stderr.read() if p.stderr and p.poll() is not None else ""
                raise NetworkSetupError(f"delay relay of {node!r} failed: {line.strip()} {err}")

    def _create_link(self, a: str, b: str, bps: float) -> None:
        link = _Link(a, b, next(self._subnets), bps)
        ia, ib = self._index[a], self._index[b]
        ea, eb = f"to-{ib}", f"to-{ia}"
        argv = ["ip", "link", "add", "name", ea, "netns", self.ns(a), "type", "veth", "peer",
                "name", eb, "netns", self.ns(b)]  # fmt: skip
        run_cmd(argv, timeout_s=self.config.command_timeout_s)
        self._links[_key(a, b)] = link
        for node, dev in ((a, ea), (b, eb)):
            ip_batch(self.ns(node), [
                f"address add {self._link_ip(link, node)}/30 dev {dev}",
                f"link set {dev} mtu {self.config.mtu} up",
            ], timeout_s=self.config.command_timeout_s)  # fmt: skip
            self._tc(node, self._shape_cmds(dev, bps, "add"))

    def _shape_cmds(self, dev: str, bps: float, verb: str) -> list[str]:
        cfg = self.config
        burst = max(int(bps / 8 * cfg.burst_s), 2 * (cfg.mtu + 14))
        limit = max(int(bps / 8 * cfg.queue_s), 2 * burst)
        tbf = f"tbf rate {int(bps)}bit burst {burst} limit {limit}"
        if self._method == "netem":
            delay_us = int(round(cfg.latency_s * 1e6))
            return [f"qdisc {verb} dev {dev} root handle 1: netem delay {delay_us}us limit 100000",
                    f"qdisc {verb} dev {dev} parent 1:1 handle 10: {tbf}"]  # fmt: skip
        return [f"qdisc {verb} dev {dev} root handle 1: {tbf}"]

    def _tc(self, node: str, cmds: Sequence[str]) -> None:
        run_cmd(["tc", "-n", self.ns(node), "-batch", "-"], stdin="\n".join(cmds) + "\n",
                timeout_s=self.config.command_timeout_s)  # fmt: skip

    # ----------------------------------------------------------------------------- routing

    def graph(self) -> nx.Graph:
        """The links that are up (cut ones left out): the graph the routes follow."""
        g = nx.Graph()
        g.add_nodes_from(self.config.nodes)
        g.add_edges_from(k for k, link in sorted(self._links.items()) if not link.cut)
        return g

    def _desired_routes(self) -> dict[str, dict[str, str]]:
        g = self.graph()
        routes: dict[str, dict[str, str]] = {}
        for src in self.config.nodes:
            paths = nx.single_source_shortest_path(g, src)
            routes[src] = {dst: p[1] for dst, p in sorted(paths.items()) if dst != src}
        return routes

    def _update_routes(self) -> None:
        desired = self._desired_routes()
        for node in self.config.nodes:
            own = self.address(node)
            old, new = self._routes[node], desired[node]
            dels = []
            for dst in sorted(set(old) - set(new)):
                dels.append(f"route del {self.address(dst)}/32")
                if self._method == "relay":
                    dels.append(f"route del {self.address(dst)}/32 table {RELAY_TABLE}")
            if dels:  # a route over a removed veth is already gone: ignore "no such route"
                argv = ["ip", "-n", self.ns(node), "-force", "-batch", "-"]
                run_cmd(argv, check=False, stdin="\n".join(dels) + "\n",
                        timeout_s=self.config.command_timeout_s)  # fmt: skip
            adds = []
            for dst, hop in new.items():
                via = self._link_ip(self._links[_key(node, hop)], hop)
                dev = f"to-{self._index[hop]}"
                real = f"route replace {self.address(dst)}/32 via {via} dev {dev} src {own}"
                if self._method == "relay":
                    adds.append(f"route replace {self.address(dst)}/32 dev {RELAY_DEV} src {own}")
                    adds.append(f"{real} table {RELAY_TABLE}")
                else:
                    adds.append(real)
            ip_batch(self.ns(node), adds, timeout_s=self.config.command_timeout_s)
            self._routes[node] = new

    def routes(self, node: str) -> dict[str, str]:
        """Destination node -> next-hop node, as installed in ``node``'s namespace.

        Raises:
            KeyError: unknown node.
        """
        self._check_node(node)
        return dict(self._routes[node])

    # ----------------------------------------------------------------------------- link changes

    def set_bandwidth(self, a: str, b: str, bandwidth_bps: float) -> None:
        """Sets link ``a``-``b``'s rate (both directions). On a cut link it applies on restore.

        Raises:
            KeyError: no such link.
            ValueError: the rate is not a positive finite number up to 100 Gbit/s.
        """
        _check_bandwidth(bandwidth_bps)
        with self._lock:
            link = self._link(a, b)
            link.bandwidth_bps = float(bandwidth_bps)
            if not link.cut:
                self._shape_link(link, "change")

    def _shape_link(self, link: _Link, verb: str) -> None:
        for node, peer in ((link.a, link.b), (link.b, link.a)):
            self._tc(node, self._shape_cmds(f"to-{self._index[peer]}", link.bandwidth_bps, verb))

    def add_link(self, a: str, b: str, bandwidth_bps: float) -> None:
        """Adds link ``a``-``b`` and recomputes every route.

        Raises:
            KeyError: unknown node.
            ValueError: the link exists, is a self-loop, or the rate is invalid.
        """
        spec = LinkSpec(a, b, float(bandwidth_bps))
        with self._lock:
            self._check_node(a)
            self._check_node(b)
            if spec.key in self._links:
                raise ValueError(f"link {a!r}-{b!r} already exists")
            self._create_link(a, b, spec.bandwidth_bps)
            self._update_routes()

    def remove_link(self, a: str, b: str) -> None:
        """Deletes link ``a``-``b`` (both veth ends) and recomputes every route.

        Nodes it disconnects lose their routes to each other.

        Raises:
            KeyError: no such link.
        """
        with self._lock:
            link = self._link(a, b)
            run_cmd(["ip", "-n", self.ns(link.a), "link", "del", f"to-{self._index[link.b]}"],
                    timeout_s=self.config.command_timeout_s)  # fmt: skip
            del self._links[_key(a, b)]
            self._update_routes()

    def cut_link(self, a: str, b: str) -> None:
        """Silently drops all traffic on link ``a``-``b`` while both devices stay up, and
        recomputes every route over the links still up (see :meth:`cut_links`).

        Raises:
            KeyError: no such link.
            ValueError: the link is already cut.
        """
        self.cut_links([(a, b)])

    def cut_links(self, links: Sequence[tuple[str, str]]) -> None:
        """Silently drops all traffic on each of ``links`` while the devices stay up, and then
        recomputes every route over the links still up, once.

        Both veth ends of each link get a ``blackhole`` root qdisc, which discards every packet
        handed to it (one ``tc`` batch per namespace); devices that other links still connect
        reach each other around the cuts. Cutting a partition's links together puts it in
        force in a fraction of the time one link at a time takes (each recomputes every
        namespace's routes).

        Raises:
            KeyError: no such link (nothing is cut).
            ValueError: a link is already cut, or named twice (nothing is cut).
        """
        self._switch(links, cut=True)

    def restore_link(self, a: str, b: str) -> None:
        """Undoes :meth:`cut_link` (see :meth:`restore_links`).

        Raises:
            KeyError: no such link.
            ValueError: the link is not cut.
        """
        self.restore_links([(a, b)])

    def restore_links(self, links: Sequence[tuple[str, str]]) -> None:
        """Undoes :meth:`cut_links`: each link carries traffic again at its current rate, and
        then every route is recomputed, once.

        Raises:
            KeyError: no such link (nothing is restored).
            ValueError: a link is not cut, or named twice (nothing is restored).
        """
        self._switch(links, cut=False)

    def _switch(self, links: Sequence[tuple[str, str]], cut: bool) -> None:
        """Cuts (``cut``) or restores ``links``: one ``tc`` batch per namespace, then the
        routes recomputed once.

        Raises:
            KeyError, ValueError: as :meth:`_links_in_state` (nothing is changed).
        """
        with self._lock:
            chosen = self._links_in_state(links, cut=not cut)
            per_node: dict[str, list[str]] = {}
            for link in chosen:
                for node, peer in ((link.a, link.b), (link.b, link.a)):
                    dev = f"to-{self._index[peer]}"
                    cmds = ([f"qdisc replace dev {dev} root blackhole"] if cut else
                            [f"qdisc del dev {dev} root",
                             *self._shape_cmds(dev, link.bandwidth_bps, "add")])  # fmt: skip
                    per_node.setdefault(node, []).extend(cmds)
            for node, cmds in per_node.items():
                self._tc(node, cmds)
            for link in chosen:
                link.cut = cut
            self._update_routes()

    def _links_in_state(self, links: Sequence[tuple[str, str]], cut: bool) -> list[_Link]:
        """The links named, each checked to be ``cut`` (or not) and named once.

        Raises:
            KeyError: no such link.
            ValueError: a link in the other state, or named twice.
        """
        out: list[_Link] = []
        for a, b in links:
            link = self._link(a, b)
            if any(link is x for x in out):
                raise ValueError(f"link {a!r}-{b!r} is named twice")
            if link.cut != cut:
                raise ValueError(f"link {a!r}-{b!r} is {'not ' if cut else 'already '}cut")
            out.append(link)
        return out

    # ----------------------------------------------------------------------------- queries

    @property
    def latency_method(self) -> Literal["none", "netem", "relay"]:
        """How latency is added: ``"none"`` (latency_s is 0), ``"netem"`` or ``"relay"``."""
        return self._method

    def ns(self, node: str) -> str:
        """The namespace name of ``node``.

        Raises:
            KeyError: unknown node.
        """
        self._check_node(node)
        return f"{self.tag}-{self._index[node]}"

    def address(self, node: str) -> str:
        """``node``'s node address (``10.255.x.y``), reachable from every connected device.

        Raises:
            KeyError: unknown node.
        """
        self._check_node(node)
        v = self._index[node] + 1
        return f"10.255.{v >> 8}.{v & 255}"

    def links(self) -> dict[tuple[str, str], LinkSpec]:
        """Current links by sorted end names (cut ones included)."""
        return {k: LinkSpec(v.a, v.b, v.bandwidth_bps) for k, v in sorted(self._links.items())}

    def is_cut(self, a: str, b: str) -> bool:
        """Whether link ``a``-``b`` is cut.

        Raises:
            KeyError: no such link.
        """
        return self._link(a, b).cut

    def _link(self, a: str, b: str) -> _Link:
        link = self._links.get(_key(a, b))
        if link is None:
            raise KeyError(f"no link {a!r}-{b!r}")
        return link

    def _check_node(self, node: str) -> None:
        if node not in self._index:
            raise KeyError(f"unknown node {node!r}")

    def _link_ip(self, link: _Link, node: str) -> str:
        base = (10 << 24) + 4 * link.subnet + (1 if node == link.a else 2)
        return ".".join(str((base >> s) & 255) for s in (24, 16, 8, 0))

    # ----------------------------------------------------------------------------- processes

    def exec(
        self, node: str, argv: Sequence[str], *, timeout_s: float = 30.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Runs ``argv`` inside ``node``'s namespace to completion (``ip netns exec``).

        Raises:
            KeyError: unknown node.
            ChaosTimeout: it ran past ``timeout_s`` (it is killed).
            NetworkSetupError: ``check`` is set and it exited non-zero.
        """
        self._require_active()
        return run_cmd(["ip", "netns", "exec", self.ns(node), *argv], timeout_s=timeout_s,
                       check=check)  # fmt: skip

    def popen(
        self, node: str, argv: Sequence[str], prefix: Sequence[str] = (), **kwargs: Any
    ) -> subprocess.Popen[Any]:
        """Starts ``argv`` inside ``node``'s namespace; the network stops it on close.

        Args:
            node: The device.
            argv: The command.
            prefix: Words run before ``ip netns exec`` (outside the namespace's fresh
                ``/sys``), e.g. :meth:`chaos.emulate.cpu_budget.CpuBudget.prefix`.
            **kwargs: Passed to :class:`subprocess.Popen`.

        Raises:
            KeyError: unknown node.
            NetworkSetupError: the network is not active.
        """
        self._require_active()
        p = subprocess.Popen([*prefix, "ip", "netns", "exec", self.ns(node), *argv], **kwargs)
        self._procs.append(p)
        return p

    def _require_active(self) -> None:
        if not self._active or self._closed:
            raise NetworkSetupError("the network is not active (use it inside its with block)")


def _key(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a <= b else (b, a)


def _check_range(
    name: str, value: float, low: float, high: float, *, low_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value > high or value < low or (low_open and value == low):
        raise ValueError(f"{name} must be in {'(' if low_open else '['}{low}, {high}], got {value}")


def _check_bandwidth(bps: float) -> None:
    _check_range("bandwidth_bps", bps, 0.0, MAX_BANDWIDTH_BPS, low_open=True)
    if bps < 8000:
        raise ValueError(f"bandwidth_bps must be at least 8000 (1 kB/s), got {bps}")


def _stop_process(p: subprocess.Popen[Any], timeout_s: float) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=timeout_s)
    for stream in (p.stdin, p.stdout, p.stderr):
        if stream is not None:
            stream.close()


def _kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(
    prefix: str = "chaos-", *, force: bool = False, timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S
) -> list[str]:
    """Removes namespaces (and the processes inside) left behind by crashed runs.

    A namespace ``<prefix><pid>-<run>-<i>`` is stale when process ``pid`` no longer exists;
    namespaces of live runs are kept unless ``force`` is set.

    Args:
        prefix: The runs' namespace prefix (:attr:`NetworkConfig.prefix`).
        force: Also remove namespaces whose creating process still runs.
        timeout_s: Timeout of each ``ip`` invocation.

    Returns:
        The names of the namespaces removed.

    Raises:
        RootRequiredError: not root.
        ValueError: bad prefix.
    """
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"prefix must match {_PREFIX_RE.pattern}, got {prefix!r}")
    require_root()
    pattern = re.compile(re.escape(prefix) + r"(\d+)-\d+-(\d+|probe)$")
    removed = []
    for ns in list_namespaces(timeout_s):
        m = pattern.match(ns)
        if not m or (not force and _pid_alive(int(m.group(1)))):
            continue
        for pid in namespace_pids(ns, timeout_s):
            _kill_pid(pid)
        run_cmd(["ip", "netns", "del", ns], check=False, timeout_s=timeout_s)
        removed.append(ns)
    return removed


_netem_cache: bool | None = None


def kernel_has_netem(prefix: str = "chaos-", timeout_s: float = DEFAULT_COMMAND_TIMEOUT_S) -> bool:
    """Whether the kernel has the ``netem`` qdisc (tried on ``lo`` in a throwaway namespace).

    Raises:
        RootRequiredError: not root.
    """
    global _netem_cache
    if _netem_cache is None:
        require_root()
        ns = f"{prefix}{os.getpid()}-{next(_run_counter)}-probe"
        run_cmd(["ip", "netns", "add", ns], timeout_s=timeout_s)
        try:
            res = run_cmd(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay",
                           "1ms"], check=False, timeout_s=timeout_s)  # fmt: skip
            _netem_cache = res.returncode == 0
        finally:
            run_cmd(["ip", "netns", "del", ns], check=False, timeout_s=timeout_s)
    return _netem_cache
