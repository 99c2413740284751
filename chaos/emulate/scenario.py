"""Emulation scenarios: a cluster, its network and a timeline of events, loadable from TOML.

A scenario file (see ``examples/scenarios/``)::

    name = "churn"
    nodes = 6                     # devices that form the cluster at the start: n0 .. n5
    degree = 2                    # each new device links to this many random running devices
    model = "resnet101"           # a paper model name, or "synthetic:MB"
    scale = 0.02                  # shrinks bandwidths and the model's state together
    bandwidth_mbps = [100, 1000]  # per-link rate range, redrawn every period_s
    period_s = 180
    latency_s = 0.0               # one-way, per link (netem, else the TUN delay relay)
    step_time_s = 0.05            # emulated compute per training step
    step_timeout_s = 60           # TrainerConfig.step_timeout_s of every device
    strategy = "chaos"            # replication strategy of the daemons
    join_mode = "catch-up"        # how joiners get the state: catch-up | barrier
    settle_s = 5                  # keep running this long after the last event
    cpu_per_device = 0.2          # optional: each device's own CPU budget, in cores (cgroups,
                                  # root); 0 (the default): every device shares every core
    inner_steps = 0               # optional: local-steps mode, an outer step every this many
                                  # inner steps; 0 (the default): synchronise every step
    overlap = false               # optional, with inner_steps: the outer step runs beside the
                                  # next inner phase
    seed = 0

    [[events]]
    at_s = 5                      # seconds after the cluster is up
    kind = "join"                 # join | leave | kill | link_add | link_remove | link_cut
                                  # | partition | heal
    join_mode = "barrier"         # optional, a join's own mode (default: the scenario's)
    [[events]]
    at_s = 15
    kind = "kill"
    node = "n3"
    [[events]]
    at_s = 25
    kind = "link_cut"
    a = "n0"
    b = "n1"
    [[events]]
    at_s = 35
    kind = "partition"            # cut these devices off from the rest
    nodes = ["n0", "n1"]
    [[events]]
    at_s = 50
    kind = "heal"                 # restore every partition and cut link

    [poisson]                      # optional: joins as a Poisson process
    rate_per_s = 0.05
    until_s = 120

A ``join`` without ``node`` gets the next free name. A ``leave``, ``kill`` or ``link_cut``
without a device or link hits any running device or link the runner draws, a cut vertex or a
bridge of the overlay included; a ``partition`` without ``nodes`` cuts off a random minority.
Everything is validated on load; a bad file raises :class:`~chaos.errors.ConfigError` naming
the field.
"""

from __future__ import annotations

import math
import random
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, cast

from chaos.errors import ConfigError
from chaos.trainer.config import JOIN_MODES

EventKind = Literal[
    "join", "leave", "kill", "link_add", "link_remove", "link_cut", "partition", "heal"
]
EVENT_KINDS: tuple[str, ...] = (
    "join", "leave", "kill", "link_add", "link_remove", "link_cut", "partition", "heal"
)  # fmt: skip
FAULT_KINDS: tuple[str, ...] = ("leave", "kill", "link_cut", "partition", "heal")
"""The events the summary reports training continuity for (a fault or its repair)."""
STRATEGIES: tuple[str, ...] = ("chaos", "even", "single-source", "multi-source")
MAX_DEVICES = 256


@dataclass(frozen=True)
class Event:
    """One timeline event.

    Args:
        at_s: When, in seconds after the initial cluster is up.
        kind: What happens.
        node: The device (join: its name; leave, kill: the device to stop). ``None``: a join
            takes the next free name; a leave or kill hits any running device the runner
            draws, a cut vertex of the overlay (even the scheduler) included.
        a: One end of a link event (``None`` with ``b``: the runner picks the link; a cut may
            hit a bridge).
        b: The other end.
        nodes: A partition's side: these devices are cut off from every other device
            (``None``: the runner draws a random minority).
        join_mode: A join's ``TrainerConfig.join_mode`` (``None``: the scenario's).
    """

    at_s: float
    kind: EventKind
    node: str | None = None
    a: str | None = None
    b: str | None = None
    nodes: tuple[str, ...] | None = None
    join_mode: str | None = None

    def __post_init__(self) -> None:
        if self.join_mode is not None and (self.kind != "join" or self.join_mode not in JOIN_MODES):
            raise ConfigError(
                f"join_mode is for join events, one of {', '.join(JOIN_MODES)}: "
                f"{self.kind} with {self.join_mode!r}"
            )
        if self.kind not in EVENT_KINDS:
            raise ConfigError(f"event kind must be one of {', '.join(EVENT_KINDS)}: {self.kind}")
        if not isinstance(self.at_s, (int, float)) or not 0 <= self.at_s < 1e6:
            raise ConfigError(f"event at_s must be in [0, 1e6) seconds, got {self.at_s!r}")
        if self.kind.startswith("link_") and (bool(self.a) != bool(self.b) or
                                              (self.a and self.a == self.b)):  # fmt: skip
            raise ConfigError(
                f"a {self.kind} event needs two distinct ends a and b, or neither (then the "
                "runner picks: a missing link to add, or any existing link)"
            )
        if self.nodes is not None:
            if self.kind != "partition":
                raise ConfigError(f"only a partition event takes nodes, not {self.kind}")
            if (not isinstance(self.nodes, tuple) or not self.nodes
                    or not all(isinstance(n, str) and n for n in self.nodes)
                    or len(set(self.nodes)) != len(self.nodes)):  # fmt: skip
                raise ConfigError(f"partition nodes must be distinct device names: {self.nodes!r}")

    def label(self) -> str:
        """Short text for tables: ``kill n3``, ``link_cut n0-n1``."""
        if self.kind.startswith("link_"):
            return f"{self.kind} {self.a}-{self.b}" if self.a else self.kind
        if self.kind == "partition":
            return f"partition {','.join(self.nodes)}" if self.nodes else self.kind
        return f"{self.kind} {self.node or ''}".strip()


def check_local_mode(inner_steps: int, overlap: bool) -> None:
    """Checks the local-steps settings of a scenario or a campaign.

    Raises:
        ConfigError: ``inner_steps`` is not an int in [0, 100000], or ``overlap`` not a bool
            or set without ``inner_steps``.
    """
    h = inner_steps
    if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h <= 100_000:
        raise ConfigError(f"inner_steps must be an int in [0, 100000], got {h!r}")
    if not isinstance(overlap, bool) or (overlap and not h):
        raise ConfigError(f"overlap must be a bool, and true only with inner_steps >= 1: "
                          f"{overlap!r}")  # fmt: skip


@dataclass(frozen=True)
class Scenario:
    """A whole emulation run; see the module docstring for the fields.

    Raises:
        ConfigError: any field out of range, or an event naming a device that does not exist
            at that time.
    """

    name: str = "scenario"
    nodes: int = 6
    degree: int = 2
    model: str = "synthetic:8"
    scale: float = 1.0
    bandwidth_mbps: tuple[float, float] = (100.0, 1000.0)
    period_s: float = 180.0
    latency_s: float = 0.0
    step_time_s: float = 0.05
    step_timeout_s: float = 60.0
    strategy: str = "chaos"
    join_mode: str = "catch-up"
    settle_s: float = 5.0
    cpu_per_device: float = 0.0
    inner_steps: int = 0
    overlap: bool = False
    seed: int = 0
    events: tuple[Event, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, int) or not 1 <= self.nodes <= MAX_DEVICES:
            raise ConfigError(f"nodes must be an int in [1, {MAX_DEVICES}], got {self.nodes!r}")
        if not isinstance(self.degree, int) or self.degree < 1:
            raise ConfigError(f"degree must be an int >= 1, got {self.degree!r}")
        lo, hi = self.bandwidth_mbps
        if not 0 < lo <= hi:
            raise ConfigError(f"bandwidth_mbps must be [low, high] with 0 < low <= high: {lo, hi}")
        for name, low, high in (("scale", 1e-6, 1.0), ("period_s", 1.0, 1e6),
                                ("latency_s", 0.0, 1.0), ("step_time_s", 0.0, 60.0),
                                ("step_timeout_s", 1.0, 3600.0),
                                ("settle_s", 0.0, 3600.0),
                                ("cpu_per_device", 0.0, 1024.0)):  # fmt: skip
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or not low <= v <= high:
                raise ConfigError(f"{name} must be in [{low}, {high}], got {v!r}")
        check_local_mode(self.inner_steps, self.overlap)
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy must be one of {', '.join(STRATEGIES)}: {self.strategy}")
        if self.join_mode not in JOIN_MODES:
            raise ConfigError(f"join_mode must be one of {', '.join(JOIN_MODES)}: {self.join_mode}")
        from chaos.models import model_summary

        try:
            model_summary(self.model)
        except ValueError as exc:
            raise ConfigError(f"model: {exc}") from exc
        self._check_timeline()

    def _check_timeline(self) -> None:
        alive = {f"n{i}" for i in range(self.nodes)}
        every = set(alive)
        for ev in sorted(self.events, key=lambda e: e.at_s):
            if ev.kind == "join":
                if ev.node in every:
                    raise ConfigError(f"join at {ev.at_s}s: {ev.node} already exists")
                alive.add(cast(str, ev.node))
                every.add(cast(str, ev.node))
            elif ev.kind in ("leave", "kill"):
                if ev.node is None:
                    continue  # the runner draws one of the running devices
                if ev.node not in alive:
                    raise ConfigError(f"{ev.kind} at {ev.at_s}s: {ev.node} is not running then")
                alive.discard(cast(str, ev.node))
            elif ev.kind == "partition" and ev.nodes is not None:
                if not set(ev.nodes) <= alive:
                    raise ConfigError(f"{ev.label()} at {ev.at_s}s names a device not running")
                if set(ev.nodes) == alive:
                    raise ConfigError(f"{ev.label()} at {ev.at_s}s leaves no device outside it")
            elif ev.a is not None and (ev.a not in every or ev.b not in every):
                raise ConfigError(f"{ev.label()} at {ev.at_s}s names an unknown device")
        if len(every) > MAX_DEVICES:
            raise ConfigError(f"the scenario uses {len(every)} devices, more than {MAX_DEVICES}")

    @property
    def devices(self) -> tuple[str, ...]:
        """Every device that ever runs: the initial ones, then the joiners in join order."""
        out = [f"n{i}" for i in range(self.nodes)]
        for ev in sorted(self.events, key=lambda e: e.at_s):
            if ev.kind == "join" and ev.node is not None:
                out.append(ev.node)
        return tuple(out)


def _name_joins(events: list[Event], nodes: int) -> list[Event]:
    """Gives every unnamed join the next free ``nK`` name, in time order."""
    taken = {e.node for e in events if e.node}
    nxt = nodes
    out = []
    for ev in sorted(events, key=lambda e: e.at_s):
        if ev.kind == "join" and not ev.node:
            while f"n{nxt}" in taken:
                nxt += 1
            name = f"n{nxt}"
            ev = replace(ev, node=name)
            taken.add(name)
        out.append(ev)
    return out


def poisson_joins(rate_per_s: float, until_s: float, seed: int) -> list[Event]:
    """Join events at the arrivals of a Poisson process of ``rate_per_s`` up to ``until_s``.

    Raises:
        ConfigError: a non-positive rate or horizon.
    """
    if not rate_per_s > 0 or not until_s > 0:
        raise ConfigError("poisson rate_per_s and until_s must be positive")
    rng = random.Random(seed)
    t, out = 0.0, list[Event]()
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= until_s:
            return out
        out.append(Event(at_s=round(t, 3), kind="join"))


def scenario_from_dict(doc: dict[str, Any]) -> Scenario:
    """Builds a validated scenario from a parsed TOML document.

    Raises:
        ConfigError: unknown keys or bad values.
    """
    known = {f for f in Scenario.__dataclass_fields__} | {"poisson"}
    unknown = set(doc) - known
    if unknown:
        raise ConfigError(f"unknown scenario keys: {', '.join(sorted(unknown))}")
    fields = {k: v for k, v in doc.items() if k not in ("events", "poisson")}
    if "bandwidth_mbps" in fields:
        bw = fields["bandwidth_mbps"]
        if not isinstance(bw, list) or len(bw) != 2:
            raise ConfigError("bandwidth_mbps must be a list [low, high]")
        fields["bandwidth_mbps"] = (float(bw[0]), float(bw[1]))
    events = []
    for raw in doc.get("events", []):
        if not isinstance(raw, dict):
            raise ConfigError("each [[events]] entry must be a table")
        bad = set(raw) - {"at_s", "kind", "node", "a", "b", "nodes", "join_mode"}
        if bad:
            raise ConfigError(f"unknown event keys: {', '.join(sorted(bad))}")
        if "nodes" in raw:
            if not isinstance(raw["nodes"], list):
                raise ConfigError(f"event nodes must be a list of device names: {raw['nodes']!r}")
            raw = {**raw, "nodes": tuple(raw["nodes"])}
        try:
            events.append(Event(**raw))
        except TypeError as exc:
            raise ConfigError(f"bad event {raw}: {exc}") from exc
    if "poisson" in doc:
        p = doc["poisson"]
        events += poisson_joins(float(p.get("rate_per_s", 0)), float(p.get("until_s", 0)),
                                int(doc.get("seed", 0)))  # fmt: skip
    fields["events"] = tuple(_name_joins(events, int(fields.get("nodes", 6))))
    try:
        return Scenario(**fields)
    except TypeError as exc:
        raise ConfigError(f"bad scenario: {exc}") from exc


def load_scenario(path: str | Path) -> Scenario:
    """Reads and validates a scenario TOML file.

    Raises:
        ConfigError: unreadable file, bad TOML or bad values.
    """
    try:
        doc = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read scenario {path}: {exc}") from exc
    return scenario_from_dict(doc)


def demo_scenario(nodes: int = 6, scale: float = 0.05, model: str = "synthetic:64") -> Scenario:
    """The demo: a join, a graceful leave, a link add, a ``kill -9``, a link cut, a partition
    of a random minority and the heal; the runner draws the victims among every running device
    and link.

    Raises:
        ConfigError: fewer than 4 nodes.
    """
    if nodes < 4:
        raise ConfigError("the demo needs at least 4 nodes")
    j = f"n{nodes}"
    events = (
        Event(at_s=3.0, kind="join", node=j),
        Event(at_s=12.0, kind="leave"),
        Event(at_s=20.0, kind="link_add"),  # before the kill: a few devices may be a full mesh
        Event(at_s=30.0, kind="kill"),
        Event(at_s=38.0, kind="link_cut"),
        Event(at_s=46.0, kind="partition"),
        Event(at_s=58.0, kind="heal"),
    )
    return Scenario(name="demo", nodes=nodes, degree=2, model=model, scale=scale,
                    step_time_s=0.05, settle_s=8.0, events=events)  # fmt: skip
