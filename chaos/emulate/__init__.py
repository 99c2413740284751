"""The emulation harness: emulated edge networks in Linux network namespaces (needs root).

It lives in ``chaos/emulate/`` because it is a user-facing tool that drives daemons and trainers
from outside, as a researcher would; nothing in the library imports it.

- :mod:`chaos.emulate.network`: :class:`Network`, one namespace per device, one tbf-shaped veth
  pair per overlay link, shortest-path routing, link add/remove/cut, cleanup on every exit path.
- :mod:`chaos.emulate.relay`: the TUN delay relay used where the kernel has no netem.
- :mod:`chaos.emulate.measure`: in-process TCP throughput and UDP latency probes.
- :mod:`chaos.emulate.schedule`: bandwidths redrawn per period, random overlays.
- :mod:`chaos.emulate.cli`: ``chaos-emulate`` (``links``, ``relay-bench``, ``cleanup``).
"""

from chaos.emulate.network import (
    LinkSpec,
    Network,
    NetworkConfig,
    NetworkSetupError,
    RootRequiredError,
    cleanup_stale,
    kernel_has_netem,
)
from chaos.emulate.schedule import BandwidthSchedule, ScheduleConfig, random_overlay

__all__ = [
    "BandwidthSchedule",
    "LinkSpec",
    "Network",
    "NetworkConfig",
    "NetworkSetupError",
    "RootRequiredError",
    "ScheduleConfig",
    "cleanup_stale",
    "kernel_has_netem",
    "random_overlay",
]
