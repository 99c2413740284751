"""How the training state is cut into shards, and which shard sizes the planners consider.

Two layouts:

* ``"flat"``: the state is one ordered byte stream (all tensors back to back), cut into shards of
  ``s`` bytes. Every shard but the last has exactly ``s`` bytes.
* ``"per-tensor"``: the paper's form. Each tensor is cut on its own, so shards never cross a tensor
  boundary and each tensor's last shard may be smaller.

Shards are described as ``(offset, length)`` ranges of the flat stream in both layouts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from chaos.scheduling.model import Neighbor

LAYOUTS = ("flat", "per-tensor")

DEFAULT_MIN_SHARD_BYTES = 1024
"""Smallest shard size the planners consider. Shards this small are dominated by the per-shard
cost on any real link; raise it to shorten the candidate list, lower it for tiny states."""

_DENSE_SHARD_COUNTS = 256
_GEOMETRIC_STEP = 1.01


def validate_problem(
    tensor_sizes: Sequence[int],
    neighbors: Sequence[Neighbor],
    per_shard_cost_s: float,
    layout: str,
) -> int:
    """Checks a planning problem and returns the state size in bytes.

    Raises:
        ValueError: no neighbours, duplicate neighbour ids, a negative or non-integer tensor
            size, an empty state, a negative or non-finite per-shard cost, or an unknown layout.
        TypeError: a neighbour is not a :class:`Neighbor`.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    if not neighbors:
        raise ValueError("no neighbours: the joiner needs at least one neighbour to pull from")
    for n in neighbors:
        if not isinstance(n, Neighbor):
            raise TypeError(f"neighbours must be Neighbor instances, got {type(n).__name__}")
    ids = [n.id for n in neighbors]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ValueError(f"duplicate neighbour ids: {dupes}")
    if isinstance(per_shard_cost_s, bool) or not isinstance(per_shard_cost_s, (int, float)):
        raise TypeError("per_shard_cost_s must be a number of seconds")
    if not math.isfinite(per_shard_cost_s) or per_shard_cost_s < 0:
        raise ValueError(f"per_shard_cost_s must be finite and >= 0, got {per_shard_cost_s!r}")
    total = 0
    for i, size in enumerate(tensor_sizes):
        if isinstance(size, bool) or not isinstance(size, int):
            raise ValueError(f"tensor_sizes[{i}] must be an int number of bytes, got {size!r}")
        if size < 0:
            raise ValueError(f"tensor_sizes[{i}] is negative ({size} bytes)")
        total += size
    if total == 0:
        raise ValueError("empty state: tensor_sizes is empty or sums to 0 bytes")
    return total


def check_shard_size(shard_size: int) -> None:
    """Raises ValueError unless ``shard_size`` is a positive int."""
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size <= 0:
        raise ValueError(f"shard size must be a positive int number of bytes, got {shard_size!r}")


def shard_classes(
    tensor_sizes: Sequence[int], shard_size: int, layout: str
) -> list[tuple[int, int]]:
    """Groups the shards by length.

    Returns:
        ``[(length, count), ...]`` sorted by decreasing length; lengths are > 0.
    """
    check_shard_size(shard_size)
    counts: dict[int, int] = {}
    pieces = [sum(tensor_sizes)] if layout == "flat" else list(tensor_sizes)
    for size in pieces:
        full, rest = divmod(size, shard_size)
        if full:
            counts[shard_size] = counts.get(shard_size, 0) + full
        if rest:
            counts[rest] = counts.get(rest, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[0])


def cut_shards(tensor_sizes: Sequence[int], shard_size: int, layout: str) -> list[tuple[int, int]]:
    """All shards as ``(offset, length)`` ranges of the flat stream, in stream order."""
    check_shard_size(shard_size)
    pieces = [sum(tensor_sizes)] if layout == "flat" else list(tensor_sizes)
    out: list[tuple[int, int]] = []
    base = 0
    for size in pieces:
        for off in range(0, size, shard_size):
            out.append((base + off, min(shard_size, size - off)))
        base += size
    return out


def candidate_shard_sizes(
    tensor_sizes: Sequence[int],
    layout: str,
    min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES,
) -> list[int]:
    """The shard sizes s that the planners consider, in increasing order.

    The candidates are ``s = ceil(L / k)`` where ``L`` is the state size (flat) or the largest
    tensor (per-tensor), for every ``k`` up to 256 and then a 1% geometric grid of ``k``, down to
    ``min_shard_bytes``. Parametrising by the shard count ``k`` puts the candidates where the
    shard count changes, so no better ``s`` hides between two neighbouring candidates with the
    same count. ``"scan"`` and ``"milp"`` search exactly this set; ``"chaos"`` bisects it.
    """
    check_shard_size(min_shard_bytes)
    span = sum(tensor_sizes) if layout == "flat" else max(tensor_sizes)
    floor_s = min(min_shard_bytes, span)
    sizes: set[int] = set()
    k = 1
    while True:
        s = -(-span // k)
        if s < floor_s:
            break
        sizes.add(s)
        if s == 1:  # every larger k gives s = 1 too; without this stop the loop never ends
            break
        k = k + 1 if k < _DENSE_SHARD_COUNTS else max(k + 1, int(k * _GEOMETRIC_STEP))
    return sorted(sizes)
