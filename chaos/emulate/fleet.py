"""The harness's records of a run: its devices (their processes and what they wrote), the
run's result, and the unshaped loopback stand-in for the emulated network.

:class:`~chaos.emulate.runner.Runner` keeps them; :mod:`chaos.emulate.metrics` derives the
figures from a :class:`RunResult`.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.emulate.network import LinkSpec
from chaos.emulate.scenario import Scenario
from chaos.launch import free_port, signal_group

__all__ = [
    "Device",
    "EmulationError",
    "Loopback",
    "RunResult",
    "log_tail",
    "stop_helper",
]


class EmulationError(RuntimeError):
    """A run could not go on: a device died unexpectedly or never became ready."""


@dataclass
class Device:
    """One running device (its training process; the daemon is its child)."""

    name: str
    proc: subprocess.Popen[bytes]
    out: Path
    daemon_dir: Path
    address: str
    started: float
    gone: str | None = None

    def records(self) -> list[dict[str, Any]]:
        """The JSON lines it wrote so far."""
        if not self.out.exists():
            return []
        recs = []
        for line in self.out.read_text().splitlines():
            if line.endswith("}"):
                recs.append(json.loads(line))
        return recs

    def ready(self) -> dict[str, Any] | None:
        return next((r for r in self.records() if r.get("kind") == "ready"), None)

    def entered(self) -> bool:
        """Its trainer is in the allreduce (its trainer's ``ready`` event). A catch-up joiner's
        device is :meth:`ready` once its snapshot is pulled, before it replays and enters."""
        return any(r.get("kind") == "trainer_event" and r.get("event") == "ready"
                   for r in self.records())  # fmt: skip

    def last_step(self) -> dict[str, Any] | None:
        steps = [r for r in self.records() if r.get("kind") == "step"]
        return steps[-1] if steps else None


@dataclass
class RunResult:
    """What a run recorded; :mod:`chaos.emulate.metrics` derives the figures."""

    scenario: Scenario
    network: str
    started: float
    harness_events: list[dict[str, Any]] = field(default_factory=list)
    devices: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    daemon_events: list[dict[str, Any]] = field(default_factory=list)
    link_rates: dict[str, float] = field(default_factory=dict)
    cpu_throttled_s: dict[str, float] = field(default_factory=dict)
    """Per device, how long its CPU budget held it back (``Scenario.cpu_per_device``)."""


class Loopback:
    """The unshaped stand-in for :class:`Network` (no root): every device on 127.0.0.1."""

    def __init__(self, devices: tuple[str, ...]) -> None:
        self._ports = {d: free_port() for d in devices}  # parallel runs never collide
        self._links: dict[tuple[str, str], LinkSpec] = {}

    def address(self, node: str) -> str:
        return "127.0.0.1"

    def port(self, node: str) -> int:
        return self._ports[node]

    def links(self) -> dict[tuple[str, str], LinkSpec]:
        return dict(self._links)

    def add_link(self, a: str, b: str, bandwidth_bps: float) -> None:
        self._links[tuple(sorted((a, b)))] = LinkSpec(a, b, bandwidth_bps)  # type: ignore[index]

    def remove_link(self, a: str, b: str) -> None:
        self._links.pop(tuple(sorted((a, b))), None)  # type: ignore[arg-type]

    def cut_link(self, a: str, b: str) -> None:
        raise EmulationError("loopback cannot drop packets: cut links with the daemons' faults")

    def popen(
        self, node: str, argv: list[str], prefix: Sequence[str] = (), **kwargs: Any
    ) -> subprocess.Popen[bytes]:
        return subprocess.Popen([*prefix, *argv], **kwargs)

    def exec(self, node: str, argv: list[str], *, timeout_s: float, check: bool) -> Any:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                              check=check)  # fmt: skip


def stop_helper(proc: subprocess.Popen[bytes]) -> None:
    """Terminates a helper process group (the checkpoint store) and reaps it."""
    signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        signal_group(proc, signal.SIGKILL)
        proc.wait(timeout=5)


def log_tail(d: Device) -> str:
    path = d.daemon_dir / "device.log"
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-15:])
    except OSError:
        return ""


def exited_error(d: Device) -> EmulationError:
    """The error for a device whose process exited when it should not have, with the tail of
    its log."""
    return EmulationError(f"device {d.name} exited with {d.proc.returncode}:\n{log_tail(d)}")
