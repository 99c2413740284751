"""Runs a :class:`~chaos.emulate.scenario.Scenario`: real devices on an emulated network.

Each device is a real training process (:mod:`chaos.emulate.device`) with its embedded
``chaos-daemon``, started inside its own network namespace. Links are veth pairs shaped with tc;
new devices link to ``degree`` random running devices, as in the paper. Events are applied at
their times; every device's step records, trainer events and daemon event log are collected,
and :mod:`chaos.emulate.metrics` turns them into the metrics of docs/emulation-runs.md.

Without root, or with ``shaped=False``, the devices run on loopback with no shaping and every
result is labelled ``"network": "loopback (unshaped)"``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Self

import networkx as nx

from chaos.emulate.cpu_budget import CpuBudget
from chaos.emulate.fleet import (
    Device,
    EmulationError,
    Loopback,
    RunResult,
    exited_error,
    log_tail,
    stop_helper,
)
from chaos.emulate.netns import NetworkSetupError
from chaos.emulate.network import LinkSpec, Network, NetworkConfig
from chaos.emulate.partitions import (
    clustered_side,
    connected_majority,
    live_components,
    partition_cut,
)
from chaos.emulate.scenario import Event, Scenario
from chaos.emulate.schedule import BandwidthSchedule, ScheduleConfig, random_overlay
from chaos.errors import ChaosTimeout
from chaos.launch import daemon_cli, signal_group, spawn_worker
from chaos.progress import LiveProgress
from chaos.security import ClusterKey

log = logging.getLogger("chaos.emulate.runner")

DAEMON_PORT = 7700
STORE_PORT = 7690
READY_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 30.0
PROBE_FULL_BYTES = 4 << 20  # the daemon's default bandwidth probe
PROBE_MIN_BYTES = 256 << 10
DAEMON_ARGS = ("--heartbeat-interval", "0.5", "--failure-timeout", "1.5",
               "--enable-fault-injection")  # fmt: skip
"""Every daemon accepts the named faults: loopback cuts and partitions are injected that way."""
FAULT_TIMEOUT_S = 30.0
"""How long one ``chaos-daemon fault`` call may take."""


class Runner:
    """Runs one scenario; use as a context manager so every process and namespace goes away.

    Args:
        scenario: What to run.
        out_dir: Where devices write their records and daemons their event logs.
        shaped: Use network namespaces and tc (needs root); ``False``: unshaped loopback.
        progress: Called with one line of text per notable happening.
    """

    def __init__(
        self,
        scenario: Scenario,
        out_dir: Path,
        shaped: bool = True,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.sc = scenario
        self.out_dir = out_dir
        self.shaped = shaped
        self.progress = progress or (lambda _msg: None)
        # separate streams: the neighbours each join gets must not depend on how many other
        # random choices (nodes to fail, links to add) came before it, so that every strategy
        # of a compare run grows the same overlay
        self.join_rng = random.Random(f"{scenario.seed}:joins")
        self.pick_rng = random.Random(f"{scenario.seed}:picks")
        self.devices: dict[str, Device] = {}
        self.retired: list[Device] = []  # earlier incarnations (stop-resume restarts)
        self.device_args: dict[str, list[str]] = {}  # more arguments of a device's next start
        label = "tc-shaped netns" if shaped else "loopback (unshaped)"
        if scenario.cpu_per_device:
            label += f", {scenario.cpu_per_device:g} cores per device"
        self.result = RunResult(scenario, label, time.time())
        self._net: Any = None
        self._cpu: CpuBudget | None = None
        self._schedule: BandwidthSchedule | None = None
        self._timeline_s: float | None = None  # a run()'s events and settle, in seconds
        self._t0 = 0.0
        self.cut: set[tuple[str, str]] = set()  # links cut by a link_cut or a partition
        self.partitions: list[tuple[str, ...]] = []  # sides cut off, until the next heal

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> Self:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        # a run in the same folder before this one left its devices' logs and control files
        # (a leave flag would make the new device leave at once): start from an empty folder
        shutil.rmtree(self.out_dir / "devices", ignore_errors=True)
        # a fresh cluster key for every run: the devices listen on non-loopback addresses,
        # and every socket (control, data plane, lanes, shard servers) authenticates with it
        self.cluster_key = self.out_dir / "cluster.key"
        self.cluster_key.unlink(missing_ok=True)
        ClusterKey.generate().write(self.cluster_key)
        sc = self.sc
        initial = [f"n{i}" for i in range(sc.nodes)]
        overlay = [(f"n{int(a[1:])}", f"n{int(b[1:])}")
                   for a, b in random_overlay(sc.nodes, sc.degree, sc.seed)]  # fmt: skip
        lo, hi = (x * 1e6 for x in sc.bandwidth_mbps)
        self._schedule = BandwidthSchedule(ScheduleConfig(lo, hi, sc.period_s, sc.scale, sc.seed))
        rates = self._schedule.draw(sorted(overlay))
        if self.shaped:
            cfg = NetworkConfig(
                nodes=sc.devices,
                links=tuple(LinkSpec(a, b, bps) for (a, b), bps in rates.items()),
                latency_s=sc.latency_s,
            )
            self._net = Network(cfg)
            self._net.__enter__()
        else:
            self._net = Loopback(sc.devices)
            for (a, b), bps in rates.items():
                self._net.add_link(a, b, bps)
        del initial
        if sc.cpu_per_device:
            try:
                self._cpu = CpuBudget(sc.cpu_per_device)
            except BaseException:
                self.close()
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stops every device (SIGTERM to its script: a graceful leave; then SIGKILL to its
        process group) and the network.

        The script leaves at its next step boundary and its embedded daemon follows (the daemon
        ignores SIGTERM: see :mod:`chaos.trainer.embedded`). The SIGKILL, sent to what is still
        running after ``STOP_TIMEOUT_S``, takes the daemon too.
        """
        if self._schedule is not None:
            self._schedule.stop()
        for d in self.devices.values():
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for d in self.devices.values():
            try:
                d.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                signal_group(d.proc, signal.SIGKILL)
                d.proc.wait(timeout=10)
            signal_group(d.proc, signal.SIGKILL)  # its daemon, if it outlived it
        self._collect()
        if self._net is not None and self.shaped:
            self._net.close()
            self._net = None
        if self._cpu is not None:
            self._cpu.close()
            self._cpu = None

    # ------------------------------------------------------------------ running

    def run(self) -> RunResult:
        """Starts the initial cluster, applies the timeline, and collects the records.

        Raises:
            EmulationError: a device failed to start or died unexpectedly.
            NetworkSetupError: the network could not be built or changed.
        """
        sc = self.sc
        self.start_cluster()
        self._timeline_s = max((e.at_s for e in sc.events), default=0.0) + sc.settle_s
        if isinstance(self.progress, LiveProgress):
            self.progress.reset(self._timeline_s, "scenario")
        for ev in sorted(sc.events, key=lambda e: e.at_s):
            delay = self._t0 + ev.at_s - time.monotonic()
            if delay > 0:
                self.watch(delay)
            self.apply(ev)
        self.watch(sc.settle_s)
        self._mark("end")
        return self.result

    def start_cluster(self) -> None:
        """Starts the initial devices one by one (each joins through its earlier neighbours).

        Raises:
            EmulationError: a device failed to start.
        """
        links = self._net.links()
        for i in range(self.sc.nodes):
            name = f"n{i}"
            nbrs = sorted({b if a == name else a for a, b in links if name in (a, b)}
                          & {f"n{j}" for j in range(i)})  # fmt: skip
            self._start_device(name, nbrs)
            self._wait_ready(name)
        self._t0 = time.monotonic()
        self._mark("cluster_up", nodes=self.sc.nodes)
        if self.shaped and self._schedule is not None:
            self._schedule.start(self._net)

    def watch(self, duration_s: float) -> None:
        """Waits ``duration_s`` while checking that no device died unexpectedly."""
        deadline = time.monotonic() + duration_s
        while True:
            for d in self.devices.values():
                code = d.proc.poll()
                if code is not None and d.gone is None:
                    raise EmulationError(f"device {d.name} exited with {code}:\n{log_tail(d)}")
            self._tick()
            left = deadline - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.2, left))

    def _tick(self) -> None:
        """Moves the live line (a :class:`LiveProgress`) to where the scenario's timeline is."""
        if self._timeline_s is None or not isinstance(self.progress, LiveProgress):
            return
        up = sum(1 for d in self.devices.values() if d.gone is None and d.proc.poll() is None)
        at = min(self._timeline_s, time.monotonic() - self._t0)
        self.progress.at(at, f"{up} devices up")

    def _mark(self, kind: str, **fields: Any) -> dict[str, Any]:
        rec = {"t": time.time(), "kind": kind, **fields}
        self.result.harness_events.append(rec)
        return rec

    # ------------------------------------------------------------------ devices

    def _endpoint(self, name: str) -> str:
        port = self._net.port(name) if not self.shaped else DAEMON_PORT
        return f"tcp://{self._net.address(name)}:{port}"

    def _start_device(
        self,
        name: str,
        neighbors: list[str],
        join: Sequence[str] = (),
        resume: tuple[Path | str, int] | None = None,
        gate: Path | None = None,
        join_mode: str | None = None,
    ) -> Device:
        """Starts device ``name`` joining through the devices ``join`` (tried in turn; none
        given: its first neighbour; no neighbour either: it founds the cluster)."""
        sc = self.sc
        old = self.devices.get(name)
        if old is not None:
            self.retired.append(old)
        incarnation = sum(1 for d in self.retired if d.name == name)
        ddir = self.out_dir / "devices" / (name if not incarnation else f"{name}.{incarnation}")
        ddir.mkdir(parents=True, exist_ok=True)
        out = ddir / "device.jsonl"
        argv = [sys.executable, "-m", "chaos.emulate.device", "--id", name,
                "--listen", self._endpoint(name), "--host", self._net.address(name),
                "--model", sc.model, "--scale", str(sc.scale), "--out", str(out),
                "--step-time", str(sc.step_time_s), "--daemon-dir", str(ddir),
                "--step-timeout", str(sc.step_timeout_s),
                "--cluster-key", str(self.cluster_key),
                "--join-mode", join_mode or sc.join_mode,
                "--inner-steps", str(sc.inner_steps)]  # fmt: skip
        if sc.overlap:
            argv.append("--overlap")
        daemon_args = [*DAEMON_ARGS, "--replication-strategy", sc.strategy]
        for n in neighbors:
            daemon_args += ["--neighbor", n]
        argv += [f"--daemon-arg={a}" for a in daemon_args]
        contacts = list(join) or neighbors[:1]
        if contacts:
            argv += ["--join", ",".join(self._endpoint(c) for c in contacts)]
        if resume is not None:  # a local file, or the store's HOST:PORT
            flag = "--resume" if isinstance(resume[0], Path) else "--resume-from"
            argv += [flag, str(resume[0]), "--wait-world", str(resume[1])]
        if gate is not None:
            argv += ["--gate", str(gate)]
        argv += self.device_args.get(name, [])
        argv += [f"--daemon-arg=--config={self._daemon_toml()}"]
        prefix = self._cpu.prefix(name) if self._cpu is not None else ()
        popen = functools.partial(self._net.popen, name, prefix=prefix)
        proc = spawn_worker(argv, log_path=ddir / "device.log", env={"OMP_NUM_THREADS": "1"},
                            popen=popen)  # fmt: skip
        dev = Device(name, proc, out, ddir, self._endpoint(name), time.time())
        self.devices[name] = dev
        via = f" (links to {', '.join(neighbors)})" if neighbors else ""
        self.progress(f"start {name}{via}")
        return dev

    def _wait_ready(self, name: str) -> dict[str, Any]:
        d = self.devices[name]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            rec = d.ready()
            if rec is not None:
                return rec
            if d.proc.poll() is not None:
                raise exited_error(d)
            time.sleep(0.1)
        raise ChaosTimeout(f"device {name} not ready after {READY_TIMEOUT_S} s:\n{log_tail(d)}")

    def wait_entered(self, name: str) -> None:
        """Waits until device ``name``'s trainer is in the allreduce (a catch-up joiner replays
        after its device is ready).

        Raises:
            EmulationError: the device exited first.
            ChaosTimeout: not in after :data:`READY_TIMEOUT_S`.
        """
        d = self.devices[name]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not d.entered():
            if d.proc.poll() is not None:
                raise exited_error(d)
            if time.monotonic() > deadline:
                raise ChaosTimeout(f"device {name} not in the allreduce after {READY_TIMEOUT_S} s")
            time.sleep(0.2)

    def running(self) -> list[str]:
        """Devices that are up and not asked to go."""
        return [n for n, d in self.devices.items() if d.gone is None and d.proc.poll() is None]

    # ------------------------------------------------------------------ events

    def apply(self, ev: Event) -> None:
        """Applies one event now (a join returns once the joiner is ready)."""
        self._apply(ev)

    def _apply(self, ev: Event) -> None:
        handler = {
            "join": self._join,
            "leave": self._leave,
            "kill": self._kill,
            "link_add": self._link_add,
            "link_remove": self._link_remove,
            "link_cut": self._link_cut,
            "partition": self._partition,
            "heal": self._heal,
        }[ev.kind]
        rec = self._mark(ev.kind, label=ev.label())
        handler(ev, rec)
        self.progress(f"{rec['kind']:<12} {rec.get('label', '')} {rec.get('note', '')}".rstrip())

    def _join(self, ev: Event, rec: dict[str, Any]) -> None:
        name = str(ev.node)
        live = self.running()
        nbrs = sorted(self.join_rng.sample(sorted(live), min(self.sc.degree, len(live))))
        for n in nbrs:
            self._net.add_link(name, n, self._rate(name, n))
        mode = ev.join_mode or self.sc.join_mode
        rec.update(node=name, neighbors=nbrs, label=f"join {name}", join_mode=mode)
        self._start_device(name, nbrs, join_mode=mode)
        ready = self._wait_ready(name)
        rec["ready_t"] = ready["t"]

    def overlay(self) -> nx.Graph:
        """The running devices and the links between them (cut links included)."""
        live = sorted(self.running())
        g = nx.Graph()
        g.add_nodes_from(live)
        g.add_edges_from((a, b) for a, b in self._net.links() if a in g and b in g)
        return g

    def _pick_node(self, ev: Event) -> str:
        """The event's node, or any running device: a cut vertex of the overlay, or the
        scheduler, is as likely as any other (the scheduler heals a split overlay)."""
        if ev.node is not None:
            return ev.node
        live = sorted(self.running())
        if len(live) < 2:
            raise EmulationError(f"no device can go: only {live} run")
        return str(self.pick_rng.choice(live))

    def _leave(self, ev: Event, rec: dict[str, Any]) -> None:
        d = self.devices[self._pick_node(ev)]
        rec["label"] = f"leave {d.name}"
        d.gone = "leave"
        d.out.with_suffix(".leave").touch()
        rec["node"] = d.name
        try:
            d.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise EmulationError(f"{d.name} did not leave within {STOP_TIMEOUT_S} s") from exc
        rec["done_t"] = time.time()
        # its links stay: its namespace keeps forwarding, as a killed device's does, so the
        # others stay reachable through it and the scheduler can heal a split overlay

    def _kill(self, ev: Event, rec: dict[str, Any]) -> None:
        d = self.devices[self._pick_node(ev)]
        rec["label"] = f"kill {d.name}"
        rec["cut_vertex"] = d.name in set(nx.articulation_points(self.overlay()))
        d.gone = "kill"
        rec["node"] = d.name
        rec["t"] = time.time()
        signal_group(d.proc, signal.SIGKILL)  # the trainer and its daemon: the device dies
        d.proc.wait(timeout=10)

    def stop_resume_join(self, name: str) -> dict[str, Any]:
        """The stop-resume baseline (Pollux): to add ``name``, the store device checkpoints,
        every device stops, then all of them and the new one restart from that checkpoint.

        An edge cluster has no shared storage besides its devices, so the first running device
        is the checkpoint store (:mod:`chaos.emulate.ckpt_store`): it writes the checkpoint to
        its disk and reads it back from there; every other restarted device, the joiner
        included, reads it over the emulated links (multi-hop where needed), all at once.

        Returns:
            The harness event, with ``scale_out_s`` (request to every device stepping together
            again), ``replication_s`` (checkpoint save plus the joiner's read), ``fetch_s``
            (each device's read), ``idle_s`` and ``state_bytes``.

        Raises:
            EmulationError: a device did not checkpoint or restart, or the store did not start.
        """
        rec = self._mark("stop_resume_join", node=name, label=f"stop-resume join {name}")
        before = self.running()  # in start order: each device links to earlier ones
        live = {n: self.devices[n] for n in before}
        store = before[0]
        for d in live.values():  # only the store writes; the others just stop
            d.out.with_suffix(".checkpoint").write_text("save" if d.name == store else "stop")
        for d in live.values():
            try:
                d.proc.wait(timeout=STOP_TIMEOUT_S * 4)
            except subprocess.TimeoutExpired as exc:
                raise EmulationError(f"{d.name} did not checkpoint in time") from exc
            d.gone = "restart"
        saved = time.time()
        ckpt = live[store].out.with_suffix(".pt")
        if not ckpt.exists():
            raise EmulationError(f"no checkpoint written by {store}:\n{log_tail(live[store])}")
        nbrs = sorted(self.join_rng.sample(sorted(before), min(self.sc.degree, len(before))))
        for n in nbrs:
            self._net.add_link(name, n, self._rate(name, n))
        members = [*before, name]
        server = self._start_store(store, ckpt)
        try:
            self._restart_all(members, store, ckpt)
            fetch = {n: self.devices[n].ready().get("checkpoint_fetch_s")  # type: ignore[union-attr]
                     for n in members}  # fmt: skip
        finally:
            stop_helper(server)
        done = self._wait_world(members, len(members))
        rec.update(neighbors=nbrs, saved_t=saved, done_t=done, scale_out_s=done - rec["t"],
                   replication_s=saved - rec["t"] + (fetch[name] or 0.0), fetch_s=fetch,
                   checkpoint_store=store, idle_s=len(before) * (done - rec["t"]),
                   state_bytes=ckpt.stat().st_size)  # fmt: skip
        self.progress(f"stop-resume  join {name}: {rec['scale_out_s']:.2f} s")
        return rec

    def _restart_all(self, members: list[str], store: str, ckpt: Path) -> None:
        """Starts every member from the checkpoint: all load in parallel (imports, the
        checkpoint read), then their daemons join in order; returns once all are ready."""
        links = self._net.links()
        gates = {}
        remote = f"{self._net.address(store)}:{STORE_PORT}"
        for i, node in enumerate(members):
            earlier = set(members[:i])
            mine = sorted({b if a == node else a for a, b in links if node in (a, b)} & earlier)
            gates[node] = self.out_dir / f"gate-{node}-{len(self.retired)}"
            via = members[0] if i and not mine else None  # its earlier links were removed
            source: Path | str = ckpt if node == store else remote
            self._start_device(node, mine, join=[via] if via else (), resume=(source, len(members)),
                               gate=gates[node])  # fmt: skip
        for node in members:  # a joiner names earlier devices
            gates[node].touch()
            self._wait_member(node)
        for node in members:
            self._wait_ready(node)

    def _start_store(self, store: str, ckpt: Path) -> subprocess.Popen[bytes]:
        """Starts the checkpoint store in ``store``'s namespace; returns once it listens.

        Raises:
            EmulationError: it exited or did not listen within ``READY_TIMEOUT_S``.
        """
        ready = self.out_dir / f"store-ready-{len(self.retired)}"
        ready.unlink(missing_ok=True)
        listen = f"{self._net.address(store)}:{STORE_PORT}"
        argv = [sys.executable, "-m", "chaos.emulate.ckpt_store", "--file", str(ckpt),
                "--listen", listen, "--ready", str(ready)]  # fmt: skip
        proc = spawn_worker(argv, log_path=self.out_dir / "store.log",
                            popen=functools.partial(self._net.popen, store))  # fmt: skip
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_helper(proc)
                log = (self.out_dir / "store.log").read_text()[-2000:]
                raise EmulationError(f"the checkpoint store on {store} did not start:\n{log}")
            time.sleep(0.02)  # polling the file the store creates
        return proc

    def _daemon_toml(self) -> Path:
        """The daemons' config file: the bandwidth probe shrinks with the scenario's scale.

        The probe is a fixed-size transfer; on links slowed down by ``scale`` it must shrink
        too, or it would take a share of the scale-out that it does not take at full scale.
        """
        path = self.out_dir / "daemon.toml"
        if not path.exists():
            probe = max(PROBE_MIN_BYTES, int(PROBE_FULL_BYTES * self.sc.scale))
            path.write_text(f"bandwidth_probe_bytes = {probe}\n"
                            f"bandwidth_probe_chunk_bytes = {min(65536, probe)}\n")  # fmt: skip
        return path

    def _wait_member(self, name: str) -> None:
        """Waits until ``name``'s daemon is a cluster member (it installed a view)."""
        d = self.devices[name]
        path = d.daemon_dir / f"events-{name}.jsonl"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if path.exists() and '"view_installed"' in path.read_text():
                return
            if d.proc.poll() is not None:
                raise exited_error(d)
            time.sleep(0.05)
        raise ChaosTimeout(f"the daemon of {name} did not join within {READY_TIMEOUT_S} s")

    def _wait_world(self, members: list[str], size: int) -> float:
        """When every member first recorded a step with ``size`` members (the latest of them)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            firsts = []
            for n in members:
                recs = [r for r in self.devices[n].records()
                        if r.get("kind") == "step" and r["world"] >= size]  # fmt: skip
                if not recs:
                    break
                firsts.append(recs[0]["t"])
            else:
                return max(firsts)
            self.watch(0.2)
        raise ChaosTimeout(f"{members} did not all step together within {READY_TIMEOUT_S} s")

    def _unlinked_pairs(self) -> list[tuple[str, str]]:
        """The pairs of running devices without a link between them."""
        live = sorted(self.running())
        g = self.overlay()
        return [(a, b) for i, a in enumerate(live) for b in live[i + 1 :] if not g.has_edge(a, b)]

    def _pick_link(self, ev: Event, existing: bool) -> tuple[str, str]:
        if ev.a is not None and ev.b is not None:
            return ev.a, ev.b
        live = sorted(self.running())
        g = self.overlay()
        if existing:  # any link, a bridge included, but not one that is cut already
            cands = [(a, b) for a, b in sorted(g.edges) if (min(a, b), max(a, b)) not in self.cut]
        else:
            cands = [(a, b) for i, a in enumerate(live) for b in live[i + 1 :]
                     if not g.has_edge(a, b)]  # fmt: skip
        if not cands:
            raise EmulationError(f"no link to pick for {ev.kind} among {live}")
        a, b = self.pick_rng.choice(cands)
        return str(a), str(b)

    def _daemon_cli(self, node: str, *args: str) -> tuple[int, float, str]:
        """Runs a ``chaos-daemon`` client command against ``node``'s daemon, through its local
        IPC socket (a path: reachable from outside the namespace; ``link``, ``leave`` and
        ``fault`` are refused over unauthenticated TCP)."""
        t0 = time.monotonic()
        res = subprocess.run(daemon_cli(*args), capture_output=True, text=True, timeout=60.0,
                             check=False, env=self._ipc_env(node))  # fmt: skip
        return res.returncode, time.monotonic() - t0, (res.stderr or "")[-300:]

    def _ipc_env(self, node: str) -> dict[str, str]:
        return {**os.environ, "CHAOS_DAEMON_DIR": str(self.devices[node].daemon_dir)}

    def _faults(self, orders: dict[str, list[str]]) -> dict[str, str]:
        """Sends ``chaos-daemon fault ARGS`` to each named device's daemon, all at once.

        Args:
            orders: The fault command's arguments (name, then peers) by device.

        Returns:
            The error text of each device whose daemon refused or did not answer.
        """
        procs = {n: subprocess.Popen(daemon_cli("fault", *args), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, env=self._ipc_env(n))
                 for n, args in orders.items() if n in self.devices}  # fmt: skip
        errors = {}
        deadline = time.monotonic() + FAULT_TIMEOUT_S
        for n, p in procs.items():
            try:
                _, err = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate(timeout=10)
                err = f"no answer within {FAULT_TIMEOUT_S} s"
            if p.returncode != 0:
                errors[n] = (err or "").strip()[-200:]
        return errors

    def _link_add(self, ev: Event, rec: dict[str, Any]) -> None:
        if ev.a is None and not self._unlinked_pairs():
            # the faults before it left a full mesh (a few devices): nothing to add
            rec.update(label="link_add", skipped=True,
                       note="skipped: every pair of running devices is linked")  # fmt: skip
            return
        a, b = self._pick_link(ev, existing=False)
        self._net.add_link(a, b, self._rate(a, b))
        code, took, err = self._daemon_cli(a, "link", "add", b)
        rec.update(a=a, b=b, label=f"link_add {a}-{b}", rc=code, cli_s=took)
        if code != 0:
            rec["note"] = f"refused: {err.strip()}"

    def _link_remove(self, ev: Event, rec: dict[str, Any]) -> None:
        a, b = self._pick_link(ev, existing=True)
        code, took, err = self._daemon_cli(a, "link", "remove", b)
        rec.update(a=a, b=b, label=f"link_remove {a}-{b}", rc=code, cli_s=took)
        self._net.remove_link(a, b)
        self.cut.discard((min(a, b), max(a, b)))
        if code != 0:
            rec["note"] = f"refused: {err.strip()}"

    def _link_cut(self, ev: Event, rec: dict[str, Any]) -> None:
        a, b = self._pick_link(ev, existing=True)
        bridges = {tuple(sorted(e)) for e in nx.bridges(self.overlay())}
        rec.update(a=a, b=b, label=f"link_cut {a}-{b}", t=time.time(),
                   bridge=tuple(sorted((a, b))) in bridges)  # fmt: skip
        self._cut_links([(a, b)], rec)

    def _cut_links(self, links: list[tuple[str, str]], rec: dict[str, Any]) -> None:
        """Cuts links: tc blackhole in the namespaces, the daemons' ``cut_link`` on loopback
        (where the control plane loses the link's frames; the data plane follows the policy)."""
        links = [(a, b) for a, b in links if (min(a, b), max(a, b)) not in self.cut]
        if self.shaped:
            self._net.cut_links(links)
            # in force from now: a step that started while the cuts went in may still finish
            # across them, and must not count as training that resumed after the fault
            rec["requested_t"], rec["t"] = rec["t"], time.time()
        else:
            orders: dict[str, list[str]] = {}
            for a, b in links:
                orders.setdefault(a, ["cut_link"]).append(b)
                orders.setdefault(b, ["cut_link"]).append(a)
            refused = self._faults(orders)
            if refused:
                rec["note"] = f"fault refused: {refused}"
            rec["requested_t"], rec["t"] = rec["t"], time.time()  # in force from now
        self.cut.update((min(a, b), max(a, b)) for a, b in links)

    def _partition(self, ev: Event, rec: dict[str, Any]) -> None:
        """Cuts a set of devices off from every other device: in the namespaces, every link
        between the side's region and the rest's is blackholed (a killed device's namespace
        still forwards: it stays with the side nearer to it, see
        :mod:`chaos.emulate.partitions`), and ``groups``/``connected_majority`` record what the
        cut left; on loopback, the side's daemons get the named fault ``partition`` (keep
        the side) and every other daemon ``cut_link`` to the side's members."""
        live = sorted(self.running())
        side = tuple(sorted(ev.nodes)) if ev.nodes else self._draw_minority(live)
        rest = [n for n in live if n not in side]
        if not rest:
            raise EmulationError(f"a partition of {side} leaves no device on the other side")
        rec.update(nodes=list(side), label=f"partition {','.join(side)}", t=time.time(),
                   majority=2 * len(side) > len(live))  # fmt: skip
        self.partitions.append(side)
        if self.shaped:
            up = self._net.graph()
            crossing = partition_cut(self._net.links(), up, side, live)
            self._cut_links(crossing, rec)
            up.remove_edges_from(crossing)
            groups = live_components(up, live)
            rec.update(links_cut=len(crossing), groups=groups,
                       connected_majority=connected_majority(groups, live))  # fmt: skip
            return
        groups = sorted([list(side), rest], key=lambda g: (-len(g), g))
        rec.update(groups=groups, connected_majority=connected_majority(groups, live))
        orders = {n: ["partition", *side] for n in side}
        orders.update({n: ["cut_link", *side] for n in rest})
        refused = self._faults(orders)
        if refused:
            rec["note"] = f"fault refused: {refused}"
        rec["requested_t"], rec["t"] = rec["t"], time.time()  # in force from now

    def _draw_minority(self, live: list[str]) -> tuple[str, ...]:
        if len(live) < 2:
            raise EmulationError(f"no partition of {live}")
        k = self.pick_rng.randint(1, max(1, (len(live) - 1) // 2))
        return self.draw_side(live, k, self.pick_rng)

    def draw_side(self, live: list[str], k: int, rng: random.Random) -> tuple[str, ...]:
        """``k`` running devices to cut off: in the namespaces, devices close to one another
        (:func:`~chaos.emulate.partitions.clustered_side`); on loopback, where every device
        reaches every other directly, any ``k``."""
        if self.shaped:
            return clustered_side(self._net.graph(), live, k, rng)
        return tuple(sorted(rng.sample(live, k)))

    def _heal(self, ev: Event, rec: dict[str, Any]) -> None:
        """Restores every link cut and every partition (loopback: ``fault clear`` on every
        running daemon)."""
        rec.update(t=time.time(), links=sorted(f"{a}-{b}" for a, b in self.cut),
                   partitions=[list(p) for p in self.partitions])  # fmt: skip
        if self.shaped:
            self._net.restore_links([(a, b) for a, b in sorted(self.cut)
                                     if (a, b) in self._net.links() and self._net.is_cut(a, b)])
            rec["requested_t"], rec["t"] = rec["t"], time.time()  # in force from now
        else:
            refused = self._faults({n: ["clear"] for n in self.running()})
            if refused:
                rec["note"] = f"fault refused: {refused}"
            rec["requested_t"], rec["t"] = rec["t"], time.time()  # in force from now
        self.cut.clear()
        self.partitions.clear()

    def _rate(self, a: str, b: str) -> float:
        sched = self._schedule
        if sched is None:
            raise EmulationError("the runner is not entered")
        return sched.draw([(a, b)])[(a, b)]

    # ------------------------------------------------------------------ collection

    def _collect(self) -> None:
        res = self.result
        for d in self.retired:
            res.devices[f"{d.name}.{d.out.parent.name}"] = d.records()
        for name, d in self.devices.items():
            res.devices[name] = d.records()
        for d in [*self.retired, *self.devices.values()]:
            name = d.name
            log_path = d.daemon_dir / f"events-{name}.jsonl"
            if log_path.exists():
                for line in log_path.read_text().splitlines():
                    try:
                        res.daemon_events.append({"node": name, **json.loads(line)})
                    except json.JSONDecodeError:
                        continue  # a line cut short by kill -9
        if self._net is not None:
            links = self._net.links().items()
            res.link_rates = {f"{a}-{b}": s.bandwidth_bps for (a, b), s in links}
        if self._cpu is not None:  # how long each device's budget held it back
            for name in self.devices:
                held = self._cpu.throttled_s(name)
                if held is not None:
                    res.cpu_throttled_s[name] = round(held, 3)


__all__ = ["NetworkSetupError", "Runner"]
