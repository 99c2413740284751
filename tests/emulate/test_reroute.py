"""The emulated network routes around a cut link, as a routed network would.

A cut (and a restore) recomputes the shortest paths over the links that are up: two devices
that other links still connect keep talking, over another path, and a connection opened before
the cut survives it; a partition (every link across it cut) still separates its sides. Needs
root; every namespace is reaped by the fixture of ``test_emulate_network.py``, even on failure.
"""

from __future__ import annotations

import pytest

from chaos.emulate import Network
from tests.emulate.test_emulate_network import (
    MBIT,
    _cfg,
    _reachable,
    _reap_namespaces,  # noqa: F401 - the autouse fixture that removes every namespace left
    _unreachable,
    cfg_index,
    needs_root,
    tcp_pair,
)

RING = [("a", "b", 100 * MBIT), ("b", "c", 100 * MBIT), ("c", "d", 100 * MBIT),
        ("d", "a", 100 * MBIT)]  # fmt: skip


@needs_root
def test_a_cut_link_is_routed_around_and_restored() -> None:
    with Network(_cfg("abcd", RING)) as net:
        with tcp_pair(net, "a", "b") as (cli, conn, _peer):
            net.cut_link("a", "b")
            assert net.routes("a")["b"] == "d"  # around the cut: a-d-c-b
            assert net.routes("b")["a"] == "c"
            out = net.exec("a", ["ip", "route", "get", net.address("b")]).stdout
            assert f"dev to-{cfg_index(net, 'd')}" in out
            assert _reachable(net, "a", "b")
            cli.sendall(b"after the cut")  # the connection opened over a-b survives
            got = b""
            while len(got) < 13:
                chunk = conn.recv(64)
                assert chunk, "the connection closed"
                got += chunk
            assert got == b"after the cut"
        net.restore_link("a", "b")
        assert net.routes("a")["b"] == "b"
        assert net.routes("b")["a"] == "a"
        assert _reachable(net, "a", "b")


@needs_root
def test_a_partition_still_separates_its_sides() -> None:
    with Network(_cfg("abcd", RING)) as net:
        net.cut_link("a", "b")
        net.cut_link("c", "d")  # sides {a, d} and {b, c}
        assert net.routes("a") == {"d": "d"}
        assert net.routes("c") == {"b": "b"}
        assert _unreachable(net, "a", "b")
        assert _unreachable(net, "a", "c")
        assert _unreachable(net, "d", "c")
        assert _reachable(net, "a", "d")
        assert _reachable(net, "b", "c")
        net.restore_link("c", "d")  # one link back joins the sides again, the long way
        assert net.routes("a")["b"] == "d"
        assert _reachable(net, "a", "b")
        assert _reachable(net, "d", "c")


@needs_root
def test_a_partition_cut_in_one_batch_separates_its_sides_and_restores_in_one() -> None:
    """cut_links puts every crossing link's blackhole in before recomputing the routes once
    (a partition in force at once); a bad batch cuts nothing."""
    with Network(_cfg("abcd", RING)) as net:
        with pytest.raises(ValueError, match="named twice"):
            net.cut_links([("a", "b"), ("b", "a")])
        with pytest.raises(KeyError):
            net.cut_links([("a", "b"), ("a", "c")])  # no a-c link
        assert not net.is_cut("a", "b")
        net.cut_links([("a", "b"), ("c", "d")])
        assert net.is_cut("a", "b") and net.is_cut("c", "d")
        assert net.routes("a") == {"d": "d"} and net.routes("c") == {"b": "b"}
        assert _unreachable(net, "a", "b") and _unreachable(net, "d", "c")
        assert _reachable(net, "a", "d") and _reachable(net, "b", "c")
        with pytest.raises(ValueError, match="already cut"):
            net.cut_links([("b", "c"), ("a", "b")])
        assert not net.is_cut("b", "c")
        net.restore_links([("a", "b"), ("c", "d")])
        assert net.routes("a")["b"] == "b"
        assert _reachable(net, "a", "b") and _reachable(net, "d", "c")
        with pytest.raises(ValueError, match="not cut"):
            net.restore_links([("a", "b")])
