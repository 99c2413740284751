"""Where a network partition cuts the emulated network (pure graph functions, no namespaces).

A partition cuts a set of running devices (its *side*) off from the other running devices (the
*rest*). In the namespaces the network holds more than the running devices: a killed or departed
device's namespace stays and still forwards, like a router. Cutting every link of the side's own
devices would also cut them off from the routers between them, so a side whose devices reach
one another only through such routers would fall apart into single devices: not one partition
but several, and a "majority" side that holds no majority anyone can reach.

A real network splits at some links between two groups instead. Here each router goes to the
side nearest it (hop count over the links that are up; a tie goes to the rest), and the links
between the two regions are the ones cut (:func:`partition_cut`). Even so, a side is not always
connected (several faults at once can leave a device with no path to its own side), so what a
partition leaves is reported as it is (:func:`live_components`), and a side drawn for a
campaign is made of devices close to one another (:func:`clustered_side`), as a region that
loses its uplink is.
"""

from __future__ import annotations

import math
import random
from collections.abc import Collection, Iterable

import networkx as nx


def _hops(graph: nx.Graph, sources: Collection[str]) -> dict[str, float]:
    present = [s for s in sources if s in graph]
    if not present:
        return {}
    return dict(nx.multi_source_dijkstra_path_length(graph, present))


def side_region(graph: nx.Graph, side: Collection[str], live: Collection[str]) -> set[str]:
    """The namespaces that end up on the side of a partition: its devices and the routers
    nearer to them than to the rest.

    Args:
        graph: The network's links that are up (every namespace a node).
        side: The running devices cut off.
        live: Every running device (the rest is ``live`` less ``side``).

    Returns:
        The side's devices and every other namespace that is not running and is strictly
        nearer to the side than to the rest (one the rest cannot reach at all included).

    Raises:
        ValueError: a device of ``side`` is not running.
    """
    side_set, live_set = set(side), set(live)
    if not side_set <= live_set:
        raise ValueError(f"devices {sorted(side_set - live_set)} of the side are not running")
    to_side = _hops(graph, side_set)
    to_rest = _hops(graph, live_set - side_set)
    region = set(side_set)
    for node in graph.nodes:
        if node in live_set:
            continue
        if to_side.get(node, math.inf) < to_rest.get(node, math.inf):
            region.add(node)
    return region


def partition_cut(
    links: Iterable[tuple[str, str]], graph: nx.Graph, side: Collection[str], live: Collection[str]
) -> list[tuple[str, str]]:
    """The links a partition of ``side`` cuts: those between the side's region
    (:func:`side_region`) and everything else.

    Args:
        links: Every link of the network, cut or not (a cut one crossing is listed too).
        graph: The links that are up.
        side: The running devices cut off.
        live: Every running device.

    Returns:
        The crossing links, sorted, each as ``(a, b)`` with ``a < b``.

    Raises:
        ValueError: a device of ``side`` is not running.
    """
    region = side_region(graph, side, live)
    return sorted({(min(a, b), max(a, b)) for a, b in links if (a in region) != (b in region)})


def live_components(graph: nx.Graph, live: Collection[str]) -> list[list[str]]:
    """The groups of running devices that can still reach one another.

    Args:
        graph: The links that are up.
        live: The running devices (one missing from ``graph`` is a group of its own).

    Returns:
        The groups, each sorted, the largest first (ties by name).
    """
    live_set = set(live)
    groups = [sorted(c & live_set) for c in nx.connected_components(graph)]
    groups = [g for g in groups if g]
    groups += [[n] for n in sorted(live_set - set(graph.nodes))]
    return sorted(groups, key=lambda g: (-len(g), g))


def connected_majority(groups: list[list[str]], live: Collection[str]) -> bool:
    """Whether one group of :func:`live_components` holds a strict majority of ``live``."""
    return any(2 * len(g) > len(live) for g in groups)


def clustered_side(
    graph: nx.Graph, live: Collection[str], k: int, rng: random.Random
) -> tuple[str, ...]:
    """Draws ``k`` running devices close to one another: a random device and the ``k - 1``
    running devices nearest it (hop count over the links that are up; ties drawn at random,
    devices it cannot reach last).

    Args:
        graph: The links that are up.
        live: The running devices.
        k: How many to draw.
        rng: The randomness (seed it for a repeatable campaign).

    Returns:
        The side, sorted.

    Raises:
        ValueError: ``k`` is not between 1 and the number of running devices.
    """
    devices = sorted(live)
    if not 1 <= k <= len(devices):
        raise ValueError(f"cannot draw {k} of {len(devices)} running devices")
    seed = rng.choice(devices)
    hops = _hops(graph, [seed])
    ranked = sorted(devices, key=lambda n: (n != seed, hops.get(n, math.inf), rng.random()))
    return tuple(sorted(ranked[:k]))
