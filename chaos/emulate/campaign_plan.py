"""The fault schedule of ``chaos-emulate chaos``: the campaign's config and its seeded plan.

:func:`draw_plan` draws the campaign's timeline from :class:`CampaignConfig` alone (the same
seed draws the same plan): Poisson-timed faults, and joins that replace what left. Victims,
links and partition sides are not part of the plan; the run loop
(:mod:`chaos.emulate.campaign`) draws them when an event happens.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from chaos.emulate.scenario import check_local_mode
from chaos.errors import ConfigError

__all__ = [
    "CAMPAIGN_KINDS", "DEFAULT_WEIGHTS", "REPLACE_AFTER_S", "CampaignConfig", "PlannedEvent",
    "draw_plan",
]  # fmt: skip

CAMPAIGN_KINDS: tuple[str, ...] = ("join", "leave", "kill", "link_cut", "partition", "heal")
DEFAULT_WEIGHTS: dict[str, float] = {
    "leave": 0.10,
    "kill": 0.30,
    "link_cut": 0.20,
    "partition": 0.15,
    "heal": 0.25,
}
"""How often each fault kind is drawn; joins come as replacements (and when the cluster is
below its size), each ``REPLACE_AFTER_S`` after the kill or leave it replaces."""
REPLACE_AFTER_S = (3.0, 10.0)


@dataclass(frozen=True)
class PlannedEvent:
    """One event of a campaign's timeline.

    Args:
        at_s: Seconds after the cluster is up.
        kind: One of :data:`CAMPAIGN_KINDS`.
        node: A join's new device name; ``None`` for the others (victims are drawn when the
            event happens, from the overlay of that moment).
        side: A partition's side: ``"minority"`` or ``"majority"`` of the running devices.
    """

    at_s: float
    kind: str
    node: str | None = None
    side: str | None = None


@dataclass(frozen=True)
class CampaignConfig:
    """A campaign's settings.

    Args:
        nodes: Devices at the start, and the size joiners refill the cluster to.
        duration_s: How long faults are injected (then a final heal and ``END_SETTLE_S``).
        rate_per_min: Faults per minute (a Poisson process; replacement joins come on top).
        seed: Seeds the plan and the victims.
        min_live: Never fewer running devices than this (a kill or leave is then skipped).
        max_live: Never more (a join is then skipped).
        weights: Relative frequency of each fault kind.
        cut_vertex_bias: Probability that a kill aims at a cut vertex of the overlay when there
            is one (0: every running device equally likely).
        degree: Links of the starting overlay per device, and links of each joiner to running
            members. 1 makes a tree, where every inner device is a cut vertex and every link a
            bridge: lower it to test the faults that split the overlay.
        model: The state each device replicates (see docs/emulation-runs.md).
        scale: Shrinks link rates and the state together.
        step_time_s: Emulated compute per step.
        step_timeout_s: Every trainer's ``TrainerConfig.step_timeout_s``: how long a round
            in which every member waits (a frame lost, nobody silent, so no straggler) holds
            the cluster before it fails and reruns. Keep it above the daemons'
            ``straggler_grace_s`` (10 s), so that a member that stops is evicted first.
        sample_s: Seconds between RSS / open-file samples.
        warmup_s: A device's samples before this many seconds after it is ready are not the
            baseline.
        keep_majority: Skip a kill or leave that would leave fewer than a strict majority of
            the committed membership running (read from a daemon's status). No consensus
            system can go on past that bound without risking two states at one step: a
            campaign that crosses it measures a cluster that is, by design, paused for good.
            ``False``: draw them anyway (the report then shows the paused cluster).
        inner_steps: Local-steps mode: every device takes an outer step every this many
            inner steps (``Scenario.inner_steps``; 0: synchronise every step). Steps are then
            outer steps in every figure.
        overlap: With ``inner_steps``: the outer step runs beside the next inner phase.
    """

    nodes: int = 6
    duration_s: float = 600.0
    rate_per_min: float = 6.0
    seed: int = 0
    min_live: int = 3
    max_live: int = 0
    weights: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    cut_vertex_bias: float = 0.5
    degree: int = 2
    model: str = "synthetic:8"
    scale: float = 0.05
    step_time_s: float = 0.05
    step_timeout_s: float = 15.0
    sample_s: float = 5.0
    warmup_s: float = 20.0
    keep_majority: bool = True
    inner_steps: int = 0
    overlap: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, int) or not 2 <= self.nodes <= 32:
            raise ConfigError(f"nodes must be an int in [2, 32], got {self.nodes!r}")
        for name, lo, hi in (("duration_s", 1.0, 7 * 86400.0), ("rate_per_min", 0.01, 600.0),
                             ("cut_vertex_bias", 0.0, 1.0), ("sample_s", 0.5, 600.0),
                             ("warmup_s", 0.0, 3600.0), ("step_time_s", 0.0, 60.0),
                             ("step_timeout_s", 1.0, 3600.0), ("scale", 1e-6, 1.0)):  # fmt: skip
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
                raise ConfigError(f"{name} must be in [{lo}, {hi}], got {v!r}")
        if not isinstance(self.min_live, int) or not 2 <= self.min_live <= self.nodes:
            raise ConfigError(f"min_live must be an int in [2, nodes], got {self.min_live!r}")
        if isinstance(self.degree, bool) or not isinstance(self.degree, int) or not (
                1 <= self.degree <= 8):  # fmt: skip
            raise ConfigError(f"degree must be an int in [1, 8], got {self.degree!r}")
        if not isinstance(self.max_live, int) or (self.max_live and self.max_live < self.nodes):
            raise ConfigError(f"max_live must be 0 (2 x nodes) or >= nodes: {self.max_live!r}")
        check_local_mode(self.inner_steps, self.overlap)
        bad = set(self.weights) - set(DEFAULT_WEIGHTS)
        if bad or any(not w >= 0 for w in self.weights.values()) or not sum(self.weights.values()):
            raise ConfigError(f"weights: kinds among {sorted(DEFAULT_WEIGHTS)}, >= 0, not all 0: "
                              f"{dict(self.weights)}")  # fmt: skip

    @property
    def live_bound(self) -> int:
        """The most devices running at once."""
        return self.max_live or 2 * self.nodes


def draw_plan(cfg: CampaignConfig) -> list[PlannedEvent]:
    """The campaign's timeline: Poisson-timed faults, and joins that replace what left.

    The plan tracks how many devices run and whether a partition is in force, so it never
    drops below ``min_live``, never goes above ``live_bound``, never partitions twice before a
    heal (a partition drawn then is a heal) and heals only when something is cut. A kill or
    leave is followed, ``REPLACE_AFTER_S`` later, by a join of a new device while the cluster
    is below ``nodes``. Only the plan's shape is drawn here: victims, links and partition sides
    are drawn when the event happens, from the overlay of that moment.

    Args:
        cfg: The campaign.

    Returns:
        The events in time order; the same config gives the same plan.
    """
    rng = random.Random(f"{cfg.seed}:plan")
    rate_s = cfg.rate_per_min / 60.0
    kinds = sorted(k for k, w in cfg.weights.items() if w > 0)
    weights = [cfg.weights[k] for k in kinds]
    faults: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate_s)
        if t >= cfg.duration_s:
            break
        faults.append(round(t, 3))
    live, cut, partitioned, nxt = cfg.nodes, 0, False, cfg.nodes
    pending: list[float] = []  # replacement joins due
    out: list[PlannedEvent] = []

    def join(at: float) -> None:
        nonlocal live, nxt
        if live < cfg.live_bound:
            out.append(PlannedEvent(at, "join", node=f"n{nxt}"))
            nxt += 1
            live += 1

    for at in faults:
        for due in sorted(x for x in pending if x <= at):
            pending.remove(due)
            if live < cfg.nodes:
                join(due)
        kind = rng.choices(kinds, weights)[0]
        if kind == "partition" and partitioned:
            kind = "heal"
        if kind == "heal" and not (cut or partitioned):
            kind = "link_cut" if "link_cut" in kinds else kind
        if kind in ("kill", "leave") and live <= cfg.min_live:
            join(at)  # the cluster is at its floor: a join instead
            continue
        if kind == "partition" and live < 3:
            kind = "link_cut"
        side = None
        if kind == "partition":
            side = rng.choice(("minority", "majority"))
            partitioned = True
        elif kind == "heal":
            cut, partitioned = 0, False
        elif kind == "link_cut":
            cut += 1
        elif kind in ("kill", "leave"):
            live -= 1
            pending.append(round(at + rng.uniform(*REPLACE_AFTER_S), 3))
        out.append(PlannedEvent(at, kind, side=side))
    for due in sorted(x for x in pending if x < cfg.duration_s):
        if live < cfg.nodes:
            join(due)
    return sorted(out, key=lambda e: e.at_s)
