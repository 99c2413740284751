"""The emulated network (chaos.emulate): namespaces, shaped links, routing, cuts, cleanup.

Tests that build namespaces need root and are skipped otherwise (CI runs as root). Every network
uses the prefix ``chaostest-`` and an autouse fixture removes whatever namespace of this test
process is left, and kills what runs inside, even when a test fails. Assertions are about
behaviour (slower, reachable, dropped, gone), never timing targets; latency is only checked
against its lower bound, which the relay guarantees by construction.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from chaos.emulate import (
    BandwidthSchedule,
    LinkSpec,
    Network,
    NetworkConfig,
    ScheduleConfig,
    cleanup_stale,
    random_overlay,
)
from chaos.emulate.measure import bulk_transfer, ping
from chaos.emulate.netns import list_namespaces, namespace_pids, netns_socket

IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(
    not IS_ROOT or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="builds network namespaces, veth pairs and tc qdiscs: needs root and iproute2 "
    "(CI runs as root)",
)
PREFIX = "chaostest-"
OWN = f"{PREFIX}{os.getpid()}-"
MBIT = 1e6


def _ours() -> list[str]:
    return [ns for ns in list_namespaces() if ns.startswith(OWN)]


@pytest.fixture(autouse=True)
def _reap_namespaces() -> Iterator[None]:
    """After every test, removes (and fails on) any namespace this process left behind."""
    yield
    if not IS_ROOT:
        return
    left = _ours()
    for ns in left:
        for pid in namespace_pids(ns):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "del", ns], check=False, timeout=10)
    assert not left, f"namespaces left behind: {left}"


def _cfg(nodes: str, links: list[tuple[str, str, float]], **kw: object) -> NetworkConfig:
    return NetworkConfig(nodes=tuple(nodes), prefix=PREFIX,
                         links=tuple(LinkSpec(a, b, bps) for a, b, bps in links),
                         **kw)  # type: ignore[arg-type]  # fmt: skip


@contextlib.contextmanager
def tcp_pair(net: Network, client: str, server: str) -> Iterator[tuple[socket.socket, socket.socket,
                                                                          tuple[str, int]]]:
    """A TCP connection from ``client`` to ``server`` (in their namespaces): the client's
    socket, the server's accepted one and the client's address as the server saw it."""
    srv = netns_socket(net.ns(server))
    cli = netns_socket(net.ns(client))
    with srv, cli:
        srv.bind((net.address(server), 0))
        srv.listen(1)
        cli.settimeout(5.0)
        cli.connect(srv.getsockname())
        srv.settimeout(5.0)
        conn, peer = srv.accept()
        with conn:
            conn.settimeout(10.0)
            yield cli, conn, peer


def _reachable(net: Network, src: str, dst: str) -> bool:
    return ping(net.ns(src), net.ns(dst), net.address(dst), count=3, interval_s=0.0,
                timeout_s=0.5).lost == 0  # fmt: skip


def _unreachable(net: Network, src: str, dst: str) -> bool:
    return ping(net.ns(src), net.ns(dst), net.address(dst), count=3, interval_s=0.0,
                timeout_s=0.3).lost == 3  # fmt: skip


# --------------------------------------------------------------------------- no root needed


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="unknown node"):
        _cfg("ab", [("a", "z", 1e6)])
    with pytest.raises(ValueError, match="duplicate link"):
        _cfg("ab", [("a", "b", 1e6), ("b", "a", 2e6)])
    with pytest.raises(ValueError, match="itself"):
        LinkSpec("a", "a", 1e6)
    with pytest.raises(ValueError, match="bandwidth_bps"):
        LinkSpec("a", "b", -5.0)
    with pytest.raises(ValueError, match="bandwidth_bps"):
        LinkSpec("a", "b", float("nan"))
    with pytest.raises(ValueError, match="not unique"):
        _cfg("aa", [])
    with pytest.raises(ValueError, match="latency_s"):
        _cfg("ab", [], latency_s=-0.01)
    with pytest.raises(ValueError, match="prefix"):
        NetworkConfig(nodes=("a",), prefix="Bad Prefix")
    with pytest.raises(TypeError):
        NetworkConfig(nodes=["a", "b"])  # type: ignore[arg-type]


def test_schedule_draws_reproducibly_within_scaled_range() -> None:
    links = [("a", "b"), ("b", "c"), ("a", "c")]
    cfg = ScheduleConfig(low_bps=100e6, high_bps=1000e6, scale=0.1, seed=7)
    first = BandwidthSchedule(cfg).draw(links)
    assert first == BandwidthSchedule(cfg).draw(links)
    assert all(10e6 <= v <= 100e6 for v in first.values())
    assert first != BandwidthSchedule(ScheduleConfig(scale=0.1, seed=8)).draw(links)
    with pytest.raises(ValueError):
        ScheduleConfig(low_bps=500e6, high_bps=100e6)


def test_a_links_rate_does_not_depend_on_the_other_links_drawn() -> None:
    """Baselines that add links in another order, or extra links, see the same rate per link."""
    cfg = ScheduleConfig(low_bps=100e6, high_bps=1000e6, scale=0.1, seed=7)
    some = BandwidthSchedule(cfg).draw([("a", "b"), ("b", "c")])
    more = BandwidthSchedule(cfg).draw([("x", "y"), ("c", "b"), ("a", "c"), ("a", "b")])
    assert some[("a", "b")] == more[("a", "b")]
    assert some[("b", "c")] == more[("c", "b")]  # either order of the ends
    assert len({some[("a", "b")], some[("b", "c")], more[("a", "c")]}) == 3


def test_random_overlay_is_connected() -> None:
    import networkx as nx

    for seed in range(5):
        g = nx.Graph(random_overlay(9, degree=2, seed=seed))
        assert sorted(g.nodes) == sorted(f"n{i}" for i in range(9))
        assert nx.is_connected(g)


def test_cli_without_root_says_so() -> None:
    code = textwrap.dedent("""
        import os, sys
        from chaos.emulate.cli import main
        os.setegid(65534); os.seteuid(65534)
        main(["links", "--nodes", "2"])
    """)
    if IS_ROOT:  # drop to nobody after the imports (the venv may not be readable by nobody)
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60)  # fmt: skip
    else:
        res = subprocess.run([sys.executable, "-m", "chaos.emulate.cli", "links"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 2
    assert "needs root" in res.stderr


# --------------------------------------------------------------------------- with namespaces


@needs_root
def test_shaping_slows_a_link_and_set_bandwidth_changes_it() -> None:
    cfg = _cfg("abc", [("a", "b", 20 * MBIT), ("a", "c", 10_000 * MBIT)])
    with Network(cfg) as net:

        def rate(dst: str) -> float:
            return bulk_transfer(net.ns("a"), net.ns(dst), net.address(dst), duration_s=0.8,
                                 warmup_s=0.3).wire_bps  # fmt: skip

        shaped, fast = rate("b"), rate("c")
        assert shaped < 1.5 * 20 * MBIT
        assert fast > 2 * shaped
        net.set_bandwidth("a", "b", 5 * MBIT)
        assert rate("b") < 0.5 * shaped
        assert net.links()[("a", "b")].bandwidth_bps == 5 * MBIT


@needs_root
def test_non_neighbours_are_reached_multi_hop() -> None:
    cfg = _cfg("abcd", [("a", "b", 100 * MBIT), ("b", "c", 100 * MBIT), ("c", "d", 100 * MBIT)])
    with Network(cfg) as net:
        assert net.routes("a") == {"b": "b", "c": "b", "d": "b"}
        assert net.routes("c")["a"] == "b"
        assert _reachable(net, "a", "d")
        assert _reachable(net, "d", "a")
        # a TCP connection across three hops
        with tcp_pair(net, "a", "d") as (cli, conn, peer):
            cli.sendall(b"hello")
            assert conn.recv(5) == b"hello"
            assert peer[0] == net.address("a")


@needs_root
def test_remove_and_add_link_update_routes() -> None:
    ring = [("a", "b", 100 * MBIT), ("b", "c", 100 * MBIT), ("c", "d", 100 * MBIT),
            ("d", "a", 100 * MBIT)]  # fmt: skip
    with Network(_cfg("abcd", ring)) as net:
        assert net.routes("a")["b"] == "b"
        net.remove_link("a", "b")
        assert net.routes("a")["b"] == "d"
        assert net.routes("b")["a"] == "c"
        out = net.exec("a", ["ip", "route", "get", net.address("b")]).stdout
        assert f"dev to-{cfg_index(net, 'd')}" in out
        assert _reachable(net, "a", "b")
        net.add_link("a", "c", 100 * MBIT)
        assert net.routes("a")["c"] == "c"
        assert _reachable(net, "a", "c")
        net.remove_link("b", "c")
        net.remove_link("a", "c")
        net.remove_link("c", "d")  # only d-a is left: b and c are isolated
        assert net.routes("a") == {"d": "d"}
        assert net.routes("c") == {}
        assert _unreachable(net, "a", "c")
        assert _unreachable(net, "a", "b")
        assert _reachable(net, "a", "d")


def cfg_index(net: Network, node: str) -> int:
    return net.config.nodes.index(node)


@needs_root
def test_cut_link_drops_traffic_while_both_ends_stay_up() -> None:
    cfg = _cfg("abc", [("a", "b", 100 * MBIT), ("b", "c", 100 * MBIT)])
    with Network(cfg) as net:
        assert _reachable(net, "a", "b")
        net.cut_link("a", "b")
        assert net.is_cut("a", "b")
        assert _unreachable(net, "a", "b")
        assert _unreachable(net, "a", "c")  # no other path
        assert net.routes("a") == {}  # a is cut off: no route left (see test_reroute.py)
        assert _reachable(net, "b", "c")  # b is up
        assert net.ns("a") in list_namespaces() and net.ns("b") in list_namespaces()
        assert "UP" in net.exec("a", ["ip", "link", "show", f"to-{cfg_index(net, 'b')}"]).stdout
        net.set_bandwidth("a", "b", 50 * MBIT)  # applies on restore
        net.restore_link("a", "b")
        assert _reachable(net, "a", "c")
        qdisc = net.exec("a", ["tc", "qdisc", "show", "dev", f"to-{cfg_index(net, 'b')}"]).stdout
        assert "tbf" in qdisc and "50Mbit" in qdisc


@needs_root
def test_relay_adds_latency_per_hop() -> None:
    delay = 0.02
    cfg = _cfg("abc", [("a", "b", 100 * MBIT), ("b", "c", 100 * MBIT)], latency_s=delay,
               latency_method="relay")  # fmt: skip
    with Network(cfg) as net:
        assert net.latency_method == "relay"
        one = ping(net.ns("a"), net.ns("b"), net.address("b"), count=5, interval_s=0.0)
        two = ping(net.ns("a"), net.ns("c"), net.address("c"), count=5, interval_s=0.0)
        assert one.lost == 0 and two.lost == 0
        assert min(one.rtts_s) >= 2 * delay  # one relay each way
        assert min(two.rtts_s) >= 4 * delay  # two hops each way
        relays = [p for ns in (net.ns("a"), net.ns("b")) for p in namespace_pids(ns)]
        assert relays
    assert all(not os.path.exists(f"/proc/{pid}") or _zombie(pid) for pid in relays)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@needs_root
def test_cleanup_when_the_body_raises() -> None:
    cfg = _cfg("abc", [("a", "b", 100 * MBIT), ("b", "c", 100 * MBIT)])
    with pytest.raises(RuntimeError, match="boom"):
        with Network(cfg) as net:
            names = [net.ns(n) for n in "abc"]
            assert set(names) <= set(list_namespaces())
            child = net.popen("b", ["sleep", "60"])
            raise RuntimeError("boom")
    assert not set(names) & set(list_namespaces())
    assert child.poll() is not None


@needs_root
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cleanup_on_signal(sig: signal.Signals) -> None:
    code = textwrap.dedent(f"""
        import sys, threading
        from chaos.emulate import LinkSpec, Network, NetworkConfig
        cfg = NetworkConfig(nodes=("a", "b"), links=(LinkSpec("a", "b", 1e8),),
                            prefix="{PREFIX}")
        with Network(cfg) as net:
            net.popen("a", ["sleep", "60"])
            print(net.tag, flush=True)
            threading.Event().wait(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        tag = p.stdout.readline().strip()
        assert tag.startswith(PREFIX)
        assert any(ns.startswith(tag + "-") for ns in list_namespaces())
        p.send_signal(sig)
        rc = p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
        cleanup_stale(PREFIX)  # the child is dead: its leftovers (if any) are stale
    assert rc != 0
    assert not [ns for ns in list_namespaces() if ns.startswith(tag + "-")]


@needs_root
def test_cleanup_stale_removes_only_dead_runs() -> None:
    dead = f"{PREFIX}999999999-0-0"  # above pid_max: no such process
    alive = f"{OWN}999-0"
    for ns in (dead, alive):
        subprocess.run(["ip", "netns", "add", ns], check=True, timeout=10)
    try:
        removed = cleanup_stale(PREFIX)
        assert dead in removed and alive not in removed
        names = list_namespaces()
        assert dead not in names and alive in names
    finally:
        for ns in (dead, alive):
            subprocess.run(["ip", "netns", "del", ns], check=False, timeout=10)


@needs_root
def test_schedule_applies_rates_to_a_network() -> None:
    cfg = _cfg("abc", [("a", "b", 100 * MBIT), ("b", "c", 100 * MBIT)])
    sched = BandwidthSchedule(ScheduleConfig(low_bps=10e6, high_bps=20e6, scale=0.5, seed=1))
    with Network(cfg) as net:
        rates = sched.apply(net)
        assert {k: v.bandwidth_bps for k, v in net.links().items()} == rates
        for node, peer in (("b", "c"), ("c", "b")):
            dev = f"to-{cfg_index(net, peer)}"
            out = net.exec(node, ["tc", "-j", "qdisc", "show", "dev", dev]).stdout
            (qdisc,) = json.loads(out)
            assert qdisc["kind"] == "tbf"
            assert qdisc["options"]["rate"] * 8 == pytest.approx(rates[("b", "c")], rel=1e-3)


@needs_root
def test_socket_in_unknown_namespace_is_a_clear_error() -> None:
    from chaos.emulate import NetworkSetupError

    with pytest.raises(NetworkSetupError, match="no network namespace"):
        netns_socket(f"{OWN}does-not-exist", socket.SOCK_DGRAM)
