"""Continuous lower bounds on the replication makespan (water-filling).

If the state could be split into arbitrarily fine pieces at no per-piece cost, the best
completion time theta solves ``sum_u max(0, (theta - prop_u - sync_u) / trans_u) = |w|``: every
neighbour that is used at all sends until the common level theta. No plan beats it.
"""

from __future__ import annotations

from collections.abc import Sequence

from chaos.scheduling.model import Neighbor


def water_level(starts: Sequence[float], rates: Sequence[float], amount: float) -> float:
    """Solves ``sum_u max(0, (theta - starts[u]) * rates[u]) = amount`` for theta.

    Args:
        starts: When each source can begin (seconds).
        rates: How much each source delivers per second once started (> 0).
        amount: How much must be delivered in total (>= 0).

    Returns:
        The level theta, in seconds.

    Raises:
        ValueError: no sources, a non-positive rate, or a negative amount.
    """
    if not starts or len(starts) != len(rates):
        raise ValueError("water_level needs one rate per start and at least one source")
    if amount < 0:
        raise ValueError(f"amount must be >= 0, got {amount}")
    if any(r <= 0 for r in rates):
        raise ValueError("every rate must be > 0")
    order = sorted(range(len(starts)), key=lambda u: starts[u])
    rate_sum = 0.0
    weighted = 0.0  # sum of starts[u] * rates[u] over the active sources
    level = starts[order[0]]
    for i, u in enumerate(order):
        rate_sum += rates[u]
        weighted += starts[u] * rates[u]
        level = (amount + weighted) / rate_sum
        nxt = starts[order[i + 1]] if i + 1 < len(order) else float("inf")
        if level <= nxt:
            return level
    return level


def lower_bound(state_bytes: int, neighbors: Sequence[Neighbor]) -> float:
    """The continuous lower bound theta (docs/scheduling.md), with no per-shard cost.

    Args:
        state_bytes: Size of the training state in bytes.
        neighbors: The joiner's neighbours with their measured link parameters.

    Returns:
        The water-filling completion time in seconds; every plan's makespan is at least this.
    """
    return water_level(
        [n.start_s for n in neighbors], [1.0 / n.trans_s_per_byte for n in neighbors], state_bytes
    )


def shard_lower_bound(
    state_bytes: int, neighbors: Sequence[Neighbor], per_shard_cost_s: float, shard_size: int
) -> float:
    """A lower bound for plans whose shards hold at most ``shard_size`` bytes.

    A neighbour sending ``b`` bytes needs at least ``b / shard_size`` shards, so its time is at
    least ``start + b * (trans + c / shard_size)``; water-filling over those rates bounds theta.
    """
    return water_level(
        [n.start_s for n in neighbors],
        [1.0 / (n.trans_s_per_byte + per_shard_cost_s / shard_size) for n in neighbors],
        state_bytes,
    )
