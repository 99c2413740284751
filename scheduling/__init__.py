"""Pure shard-assignment and sync-policy algorithms. No sockets, no files, no torch.

Public API::

    from chaos.scheduling import Neighbor, plan_replication, Plan, lower_bound
"""

from chaos.scheduling.bounds import lower_bound, shard_lower_bound, water_level
from chaos.scheduling.layout import LAYOUTS, candidate_shard_sizes, cut_shards
from chaos.scheduling.missing import map_to_ranges, plan_missing
from chaos.scheduling.model import Neighbor, Plan, finish_times, makespan
from chaos.scheduling.plan import METHODS, PlanMethod, plan_replication

__all__ = [
    "LAYOUTS",
    "METHODS",
    "PlanMethod",
    "Neighbor",
    "Plan",
    "candidate_shard_sizes",
    "cut_shards",
    "finish_times",
    "lower_bound",
    "makespan",
    "map_to_ranges",
    "plan_missing",
    "plan_replication",
    "shard_lower_bound",
    "water_level",
]
