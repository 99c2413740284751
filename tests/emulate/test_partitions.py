"""Where a partition cuts the emulated network (``chaos.emulate.partitions``: pure graphs).

Routers are the namespaces of devices that no longer run: they still forward. A partition
keeps the routers nearest a side with it, so the side's devices still reach one another
through them; a side whose devices lie apart still falls into pieces, and that is reported.
"""

from __future__ import annotations

import random

import networkx as nx
import pytest

from chaos.emulate.partitions import (
    clustered_side,
    connected_majority,
    live_components,
    partition_cut,
    side_region,
)


def _graph(*edges: tuple[str, str]) -> nx.Graph:
    g = nx.Graph()
    g.add_edges_from(edges)
    return g


def _after(g: nx.Graph, cut: list[tuple[str, str]]) -> nx.Graph:
    h = g.copy()
    h.remove_edges_from(cut)
    return h


def test_a_side_keeps_the_router_between_its_devices() -> None:
    # a and b reach each other only through router r; c sits behind router s
    g = _graph(("a", "r"), ("b", "r"), ("r", "s"), ("c", "s"), ("d", "s"))
    live = ["a", "b", "c", "d"]
    assert side_region(g, ["a", "b"], live) == {"a", "b", "r"}
    cut = partition_cut(g.edges, g, ["a", "b"], live)
    assert cut == [("r", "s")]  # not a-r and b-r, which would leave a and b alone
    groups = live_components(_after(g, cut), live)
    assert groups == [["a", "b"], ["c", "d"]]
    assert not connected_majority(groups, live)  # an even split: neither side has a majority


def test_a_router_as_near_to_both_sides_stays_with_the_rest() -> None:
    g = _graph(("a", "r"), ("r", "b"), ("b", "c"))
    live = ["a", "b", "c"]
    assert side_region(g, ["a"], live) == {"a"}
    assert partition_cut(g.edges, g, ["a"], live) == [("a", "r")]


def test_a_side_whose_devices_lie_apart_falls_into_pieces_and_no_majority_is_left() -> None:
    # a - b - c - d - e, all running: a side of a, c and e is cut off from b and d
    g = _graph(("a", "b"), ("b", "c"), ("c", "d"), ("d", "e"))
    live = ["a", "b", "c", "d", "e"]
    cut = partition_cut(g.edges, g, ["a", "c", "e"], live)
    assert cut == [("a", "b"), ("b", "c"), ("c", "d"), ("d", "e")]
    groups = live_components(_after(g, cut), live)
    assert sorted(map(len, groups)) == [1, 1, 1, 1, 1]
    assert not connected_majority(groups, live)


def test_a_cut_link_already_down_is_still_listed_as_crossing() -> None:
    links = [("a", "b"), ("b", "c"), ("a", "c")]
    up = _graph(("a", "b"), ("b", "c"))  # a-c is cut already
    up.add_node("a")
    cut = partition_cut(links, up, ["a"], ["a", "b", "c"])
    assert cut == [("a", "b"), ("a", "c")]


def test_components_put_the_largest_group_first_and_count_unlinked_devices() -> None:
    g = _graph(("a", "b"), ("c", "r"))
    groups = live_components(g, ["a", "b", "c", "z"])  # z has no link at all
    assert groups == [["a", "b"], ["c"], ["z"]]
    assert not connected_majority(groups, ["a", "b", "c", "z"])
    assert connected_majority([["a", "b"], ["c"]], ["a", "b", "c"])


@pytest.mark.parametrize("seed", range(20))
def test_a_clustered_side_is_connected_on_a_line(seed: int) -> None:
    names = [f"n{i}" for i in range(8)]
    g = _graph(*zip(names, names[1:], strict=False))
    side = clustered_side(g, names, 3, random.Random(seed))
    assert len(side) == 3 and nx.is_connected(g.subgraph(side))


def test_a_clustered_side_is_repeatable_and_checks_its_size() -> None:
    g = _graph(("a", "b"), ("b", "c"), ("c", "d"))
    live = ["a", "b", "c", "d"]
    assert clustered_side(g, live, 2, random.Random(5)) == clustered_side(g, live, 2,
                                                                           random.Random(5))
    with pytest.raises(ValueError, match="cannot draw 0 of 4"):
        clustered_side(g, live, 0, random.Random(1))
    with pytest.raises(ValueError, match="cannot draw 5 of 4"):
        clustered_side(g, live, 5, random.Random(1))


def test_a_side_must_be_running() -> None:
    g = _graph(("a", "b"))
    with pytest.raises(ValueError, match=r"\['x'\] of the side are not running"):
        side_region(g, ["x"], ["a", "b"])
