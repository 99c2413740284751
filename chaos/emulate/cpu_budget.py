"""A CPU budget of its own for every emulated device (Linux cgroups' CPU bandwidth limit).

The emulated devices of a run share this machine's cores. Without a budget, whatever one device
does (a joiner's pull, checksums and replay, a new device importing torch) takes CPU time from
the others, and their step rate falls for a reason no real device has: on real hardware a
joiner's work runs on the joiner. With ``cpu_per_device`` set, every device's processes (its
training process and the ``chaos-daemon`` it starts) run in a cgroup of their own, limited to
that many cores (``cpu.cfs_quota_us`` over ``cpu.cfs_period_us`` on cgroup v1, ``cpu.max`` on
v2). A device can then neither take more than its share nor lose it to another device, as on
separate machines. The harness's own processes (the latency relay, the runner) stay outside.

The decision of the limit (:func:`quota_us`) is pure; :class:`CpuBudget` does the file I/O. A
process joins its group before it runs anything: the start command is prefixed with a shell
line that writes its own pid into the group and then ``exec``\\ s the rest
(:meth:`CpuBudget.prefix`), outside ``ip netns exec``, whose fresh ``/sys`` hides the cgroup
mounts.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from chaos.emulate.fleet import EmulationError

log = logging.getLogger("chaos.emulate")

PERIOD_US = 100_000
"""The accounting period of the bandwidth limit (the kernel's default, 100 ms)."""
MIN_QUOTA_US = 1_000
"""The smallest quota the kernel takes (1 ms per period)."""
CGROUP_ROOT = Path("/sys/fs/cgroup")
CLOSE_WAIT_S = 5.0
"""How long :meth:`CpuBudget.close` retries removing a group whose processes are still exiting."""


def quota_us(cores: float, period_us: int = PERIOD_US) -> int:
    """The quota per period that limits a group to ``cores`` cores.

    Raises:
        ValueError: ``cores`` is not a finite number above zero, or gives under 1 ms a period.
    """
    if isinstance(cores, bool) or not isinstance(cores, (int, float)) or not 0 < cores < 1e4:
        raise ValueError(f"cpu per device must be a number of cores above 0, got {cores!r}")
    q = round(cores * period_us)
    if q < MIN_QUOTA_US:
        raise ValueError(f"cpu per device {cores} is under the kernel's smallest quota "
                         f"({MIN_QUOTA_US / period_us} of a core)")  # fmt: skip
    return q


def find_cpu_controller(root: Path = CGROUP_ROOT) -> tuple[Path, int]:
    """Where the CPU controller is mounted, and its cgroup version (1 or 2).

    Raises:
        EmulationError: no CPU controller this process may use.
    """
    unified = root / "cgroup.controllers"
    if unified.exists() and "cpu" in unified.read_text().split():
        return root, 2
    if (root / "cpu" / "cpu.cfs_quota_us").exists():
        return root / "cpu", 1
    raise EmulationError(
        f"a CPU budget per device needs the cgroup cpu controller (v1 {root}/cpu or v2 {root} "
        "with cpu enabled): neither is there"
    )


class CpuBudget:
    """One cgroup per device under a group of this run, each limited to ``cores`` cores.

    Args:
        cores: Each device's limit, in cores (e.g. 0.2: 20 ms of CPU time per 100 ms).
        root: The cgroup file system's mount point.

    Raises:
        EmulationError: no usable CPU controller, or the run's group cannot be made (not root).
        ValueError: ``cores`` out of range.
    """

    def __init__(self, cores: float, root: Path = CGROUP_ROOT) -> None:
        self.cores = cores
        self._quota = quota_us(cores)
        self._base, self._version = find_cpu_controller(root)
        self._run = self._base / f"chaos-emulate-{os.getpid()}"
        if self._version == 2:  # children of a v2 group get the cpu controller only if asked
            self._write(self._base / "cgroup.subtree_control", "+cpu")
        try:
            self._run.mkdir(exist_ok=True)
        except OSError as exc:
            raise EmulationError(f"cannot make the cgroup {self._run} ({exc}): a CPU budget "
                                 "per device needs root") from exc  # fmt: skip
        if self._version == 2:
            self._write(self._run / "cgroup.subtree_control", "+cpu")
        self._groups: dict[str, Path] = {}

    def group(self, device: str) -> Path:
        """The device's group (made and limited on first use)."""
        g = self._groups.get(device)
        if g is None:
            g = self._run / device
            g.mkdir(exist_ok=True)
            if self._version == 2:
                self._write(g / "cpu.max", f"{self._quota} {PERIOD_US}")
            else:
                self._write(g / "cpu.cfs_period_us", str(PERIOD_US))
                self._write(g / "cpu.cfs_quota_us", str(self._quota))
            self._groups[device] = g
        return g

    def prefix(self, device: str) -> tuple[str, ...]:
        """The words to put before a device's start command: the shell writes its own pid into
        the device's group, then runs the rest in its place (so every child is in it too)."""
        procs = self.group(device) / "cgroup.procs"
        return ("sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs))

    def throttled_s(self, device: str) -> float | None:
        """How long the device's processes were held back by the limit so far, in seconds
        (``None``: no group): near zero means the budget never bound."""
        g = self._groups.get(device)
        if g is None or not (g / "cpu.stat").exists():
            return None
        key, scale = ("throttled_usec", 1e-6) if self._version == 2 else ("throttled_time", 1e-9)
        for line in (g / "cpu.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value) * scale
        return None

    def close(self) -> None:
        """Removes the groups. Their processes are stopped by then; a group whose last process
        is still exiting is retried for :data:`CLOSE_WAIT_S`, then left with a warning."""
        for g in [*self._groups.values(), self._run]:
            deadline = time.monotonic() + CLOSE_WAIT_S
            while g.exists():
                try:
                    g.rmdir()
                except OSError as exc:
                    if time.monotonic() >= deadline:
                        log.warning("cgroup %s not removed: %s", g, exc)
                        break
                    time.sleep(0.1)
        self._groups.clear()

    @staticmethod
    def _write(path: Path, text: str) -> None:
        try:
            path.write_text(text)
        except OSError as exc:
            raise EmulationError(f"cannot write {text!r} to {path}: {exc}") from exc


def cleanup_stale_groups(root: Path = CGROUP_ROOT) -> list[Path]:
    """Removes the groups of runs whose process is gone (a harness killed with ``kill -9``);
    their devices were killed with their namespaces (``chaos-emulate cleanup``).

    Returns:
        The groups removed. None when there is no CPU controller.
    """
    try:
        base, _ = find_cpu_controller(root)
    except EmulationError:
        return []
    removed = []
    for run in sorted(base.glob("chaos-emulate-*")):
        pid = run.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        for g in [*sorted(p for p in run.iterdir() if p.is_dir()), run]:
            try:
                g.rmdir()
                removed.append(g)
            except OSError as exc:  # a process still in it
                log.warning("cgroup %s not removed: %s", g, exc)
    return removed
