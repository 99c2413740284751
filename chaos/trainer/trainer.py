"""The Trainer API: a few lines that make a PyTorch script an elastic, self-healing cluster member.

Usage (paper Listings 1 and 2)::

    from chaos.trainer import Trainer, capture_exit_event

    trainer = Trainer(model, optimizer, join="tcp://HOST:PORT")   # or join=None: new cluster
    for x, y in loader:
        loss = loss_fn(model(x), y); loss.backward()
        trainer.update()                   # allreduce gradients, then optimizer step
        trainer.check_state_replication()  # serve my shards if the scheduler asked me to
        if capture_exit_event():
            trainer.request_node_exit()
            break

The trainer owns the data plane (see ``docs/trainer.md`` and
``docs/trainer-daemon-interface.md``): it allreduces gradients over the sync policy's topology,
serves state shards to joiners, and, when it joins, pulls the state from several neighbours at
once. The local daemon owns the control plane: it publishes a notice whenever its epoch changes
(:mod:`chaos.trainer.policy_watch`), and the trainer asks it for the policy at a step boundary
only when a notice names a newer epoch (or the notices fall silent), and, while it waits in an
allreduce, every ``poll_interval_s``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from chaos import ops
from chaos.collectives import Communicator, CommunicatorConfig, Topology
from chaos.errors import (
    ChaosError,
    ChaosTimeout,
    ConfigError,
    DaemonGone,
    PeerFailure,
    ReplicationError,
    RoundInterrupted,
)
from chaos.launch import free_tcp_address
from chaos.protocol import PolicyReply
from chaos.replication.pull import PullConfig, gather_manifests, plan_for_snapshot, pull_state
from chaos.replication.server import ShardServer, ShardServerConfig
from chaos.replication.state import TrainingState
from chaos.scheduling import Neighbor
from chaos.scheduling.bounds import lower_bound
from chaos.trainer.embedded import EmbeddedDaemon
from chaos.trainer.exit_signals import (  # capture_exit_event and request_exit are part of this API
    capture_exit_event as capture_exit_event,
)
from chaos.trainer.exit_signals import install_exit_handlers
from chaos.trainer.exit_signals import request_exit as request_exit
from chaos.trainer.policy_watch import PolicyWatch

log = logging.getLogger("chaos.trainer")


class TrainingStalled(ChaosError):
    """A step could not be completed: no new policy came after a failure within the timeout."""


@dataclass(frozen=True)
class TrainerConfig:
    """Options of a :class:`Trainer` (the ``**options`` of its constructor).

    Args:
        host: Interface the data-plane endpoints bind to (and advertise).
        step_timeout_s: Longest wait for the next allreduce frame before the neighbour is
            declared failed. Raise it when a step's compute time varies a lot between devices.
        policy_timeout_s: Longest wait for a new policy after a failed allreduce. It must exceed
            the daemon's failure timeout (1.5 s by default).
        join_timeout_s: Longest wait for the daemon to join and the scheduler to plan the join.
        replication_timeout_s: Limit on pulling the whole state when joining.
        poll_interval_s: How often the trainer asks its daemon for a newer policy while blocked
            in an allreduce. Lower reacts faster to membership changes, at a small CPU cost.
        chunk_bytes: Allreduce frame size; see :class:`CommunicatorConfig`.
        wire_dtype: ``None``, ``"float16"`` or ``"bfloat16"`` gradient wire format.
        lanes: Send the gradient chunks over plain TCP payload lanes beside ZeroMQ (faster:
            no copy out of ZeroMQ's buffers); turn it off where only the data endpoint's port
            may be opened between devices. See :attr:`CommunicatorConfig.lanes`.
        daemon_args: Extra ``chaos-daemon start`` arguments for the embedded daemon.
        daemon_dir: The embedded daemon's run directory (IPC socket, event log); default: a
            fresh temporary directory.
        pull_window: Outstanding shard requests per donor while joining.
        policy_notices: Learn of newer policies from the daemon's published notices, asking the
            daemon only when one names a newer epoch (or the notices fall silent). ``False``:
            ask at every step boundary (an IPC round trip each), as a comparison baseline.
        restored: The model and optimizer were loaded from a checkpoint that every member
            restores (the stop-resume baseline): the trainer joins with that state instead of
            pulling one; the scheduler admits it only if its state digest equals the first
            trainer's. Such members should not step until all of them are in (see
            :meth:`Trainer.wait_world`).

    Raises:
        ConfigError: a non-positive timeout or interval.
    """

    host: str = "127.0.0.1"
    step_timeout_s: float = 30.0
    policy_timeout_s: float = 10.0
    join_timeout_s: float = 60.0
    replication_timeout_s: float = 600.0
    poll_interval_s: float = 0.02
    chunk_bytes: int = 1 << 20
    wire_dtype: str | None = None
    lanes: bool = True
    daemon_args: tuple[str, ...] = ()
    daemon_dir: str | None = None
    pull_window: int = 8
    policy_notices: bool = True
    restored: bool = False

    def __post_init__(self) -> None:
        for name in (
            "step_timeout_s",
            "policy_timeout_s",
            "join_timeout_s",
            "replication_timeout_s",
            "poll_interval_s",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        if not isinstance(self.daemon_args, tuple):
            raise ConfigError("daemon_args must be a tuple of strings")


# ----------------------------------------------------------------------------- the trainer


@dataclass
class _Policy:
    epoch: int
    topo_epoch: int
    """The epoch of its data-plane structure (``SyncPolicyWire.topology_epoch``), which the
    allreduce frames carry; at most ``epoch``."""
    members: tuple[str, ...]
    topology: Topology | None
    replication: Any
    paused: bool
    raw: Any = field(repr=False, default=None)


def _raw_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes, as laid out in memory once contiguous (for digests)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _topo_epoch(reply: Any) -> int:
    """The epoch the allreduce frames of this policy carry (see ``topology_epoch``)."""
    sync = reply.sync
    return int(sync.topology_epoch) if sync is not None and sync.topology_epoch else reply.epoch


def _topology(reply: Any, me: str) -> Topology | None:
    sync = reply.sync
    if sync is None or me not in sync.nodes or not sync.connected:
        return None  # not a member, or a split overlay: wait for a policy that joins it up
    addresses = dict(sync.addresses)
    epoch = _topo_epoch(reply)
    if sync.kind == "ring" and sync.ring:
        return Topology("ring", tuple(sync.nodes), addresses, epoch, ring_order=tuple(sync.ring))
    if sync.kind == "tree" and sync.parents:
        return Topology("tree", tuple(sync.nodes), addresses, epoch, parent=dict(sync.parents))
    return Topology(
        "ring", (me,), {me: addresses.get(me, "tcp://127.0.0.1:1")}, epoch, ring_order=(me,)
    )


def _default_node_id() -> str:
    """``HOSTNAME-PID``, with the characters a node id cannot hold replaced and the host name
    cut so that the id stays within 64 characters."""
    host = re.sub(r"[^A-Za-z0-9_.:-]", "-", socket.gethostname())[:48] or "node"
    return f"{host}-{os.getpid()}"


def _check_endpoints(
    join: str | None, daemon: str | None, node_id: str | None, listen: str | None
) -> None:
    """Rejects malformed endpoints and node ids before a daemon is started or dialled.

    Raises:
        ConfigError: one of them is malformed.
    """
    from chaos.daemon.config import check_daemon_endpoint, check_node_id, check_tcp_endpoint

    if node_id is not None:
        check_node_id(node_id)
    if join is not None:
        check_tcp_endpoint(join, "join endpoint")
    if listen is not None:
        check_tcp_endpoint(listen, "listen endpoint")
    if daemon is not None:
        check_daemon_endpoint(daemon)


class Trainer:
    """Makes this training process a member of an elastic Chaos cluster.

    Args:
        model: The model; its parameters' gradients are averaged over the members each step.
        optimizer: Its optimizer; stepped by :meth:`update` after the allreduce.
        join: A member's daemon endpoint (``tcp://HOST:PORT``) to join through, or ``None`` to
            start a new cluster with this process's state.
        daemon: The local daemon's endpoint (``ipc://...``); ``None`` starts an embedded daemon.
        node_id: This node's id (default: ``HOSTNAME-PID``). With ``daemon=``, it must be that
            daemon's id.
        listen: The embedded daemon's control endpoint (default: a free port on ``host``).
        **options: :class:`TrainerConfig` fields.

    Raises:
        ConfigError: bad options, or a malformed endpoint or node id (checked before anything
            starts).
        chaos.trainer.embedded.DaemonStartError: the embedded daemon could not start or join.
        ChaosTimeout: the join or the state pull did not finish in time.
        ReplicationError: the state could not be pulled from any neighbour.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        join: str | None = None,
        daemon: str | None = None,
        node_id: str | None = None,
        listen: str | None = None,
        **options: Any,
    ) -> None:
        from chaos.daemon.client import DaemonClient

        try:
            self.config = TrainerConfig(**options)
        except TypeError as exc:
            raise ConfigError(f"unknown Trainer option: {exc}") from exc
        _check_endpoints(join, daemon, node_id, listen)
        install_exit_handlers()
        # Build or load the native ops now: a first JIT build takes 30-60 s, which must not
        # happen inside a donor's serving thread or an allreduce with a timeout.
        ops.native_available()
        self.model = model
        self.optimizer = optimizer
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        self.node_id = node_id if node_id is not None else _default_node_id()
        self._step = 0
        self._epoch = -1
        self._policy: _Policy | None = None
        self._published: tuple[int, int] | None = None
        self._last_contact = time.monotonic()  # last answer from the local daemon
        self._watch: PolicyWatch | None = None
        self._fetched_epoch = -1  # the newest epoch a fetch returned (carried ones never older)
        self._layout: list[int] | None = None
        self.events: list[dict[str, Any]] = []
        self._embedded: EmbeddedDaemon | None = None
        t0 = time.monotonic()
        try:
            address = daemon if daemon is not None else self._start_embedded(join, listen)
            self._client = DaemonClient(address, timeout_s=5.0)
            self._comm, self._server = self._open_data_plane()
            self._register_and_sync(join is not None, t0)
        except BaseException:
            self.close()
            raise

    def _start_embedded(self, join: str | None, listen: str | None) -> str:
        """Starts this node's own daemon (joining ``join``, or a new cluster); returns its
        endpoint once it is a member."""
        embedded = EmbeddedDaemon(
            self.node_id,
            listen or free_tcp_address(self.config.host),
            join,
            self.config.daemon_args,
            self.config.daemon_dir,
        )
        try:
            embedded.wait_ready(self.config.join_timeout_s)
        except BaseException:
            embedded.stop(timeout_s=2.0)
            raise
        self._embedded = embedded
        return embedded.endpoint

    def _open_data_plane(self) -> tuple[Communicator, ShardServer]:
        """The allreduce communicator and the shard server, on ephemeral ports."""
        host = self.config.host
        comm = Communicator(
            CommunicatorConfig(
                self.node_id,
                listen=f"tcp://{host}:*",
                chunk_bytes=self.config.chunk_bytes,
                timeout_s=self.config.step_timeout_s,
                wire_dtype=self.config.wire_dtype,
                lanes=self.config.lanes,
                poll_slice_s=min(0.1, self.config.poll_interval_s),
            )
        )
        comm.set_interrupt(self._newer_policy, self.config.poll_interval_s)
        try:
            return comm, ShardServer(ShardServerConfig(listen=f"tcp://{host}:*"))
        except BaseException:
            comm.close()
            raise

    # ------------------------------------------------------------------ properties

    @property
    def step(self) -> int:
        """Optimizer steps taken by the cluster so far (equal on every member)."""
        return self._step

    @property
    def epoch(self) -> int:
        """The membership epoch of the policy in force."""
        return self._epoch

    @property
    def world_size(self) -> int:
        """Members taking part in the allreduce under the current policy."""
        return len(self._policy.members) if self._policy else 1

    @property
    def neighbors(self) -> list[str]:
        """This node's overlay neighbours, as the daemon knows them."""
        st = self._client.status()
        mine = next((n for n in st.nodes if n.id == self.node_id), None)
        return sorted(mine.neighbors) if mine else []

    # ------------------------------------------------------------------ joining

    def _register_and_sync(self, joining: bool, t0: float) -> None:
        restored = self.config.restored
        if restored:
            joining = False
        sizes = None if joining else self._capture(0).tensor_sizes()
        self._layout = sizes
        self._client.register_trainer(
            data_address=self._comm.address,
            shard_address=self._server.address,
            has_state=not joining,
            tensor_sizes=sizes,
            timeout_s=self.config.join_timeout_s,
            state_digest=self._restored_digest() if restored else "",
        )
        policy = self._wait_policy(
            lambda p: self.node_id in p.members and p.topology is not None,
            self.config.join_timeout_s,
            "the scheduler to add this trainer to the sync policy",
        )
        if joining:
            self._pull(policy)
        self._install(policy)
        elapsed = time.monotonic() - t0
        self._event("ready", elapsed_s=elapsed, epoch=self._epoch, step=self._step)
        self._client.trainer_event(
            "ready", elapsed, f"epoch {self._epoch} step {self._step}", timeout_s=5.0
        )

    def _restored_digest(self) -> str:
        """SHA-256 over the model's and optimizer's tensors (not the per-device RNG)."""
        h = hashlib.sha256()
        for name, t in self.model.state_dict().items():
            h.update(name.encode())
            h.update(_raw_bytes(t))
        for p in self._params:
            for key, v in sorted(self.optimizer.state.get(p, {}).items()):
                if isinstance(v, torch.Tensor):
                    h.update(key.encode())
                    h.update(_raw_bytes(v))
        return h.hexdigest()

    def wait_world(self, size: int, timeout_s: float) -> None:
        """Blocks until the sync policy holds at least ``size`` members (stop-resume restarts).

        Raises:
            ChaosTimeout: fewer members after ``timeout_s``.
        """
        policy = self._wait_policy(
            lambda p: len(p.members) >= size and p.topology is not None,
            timeout_s,
            f"{size} members",
        )
        if policy.epoch > self._epoch:
            self._install(policy)

    def _pull(self, policy: _Policy) -> None:
        rep = policy.replication
        if rep is None or rep.target != self.node_id or not rep.donor_addresses:
            raise ReplicationError(
                f"the policy of epoch {policy.epoch} names no donor for {self.node_id}: "
                f"{getattr(rep, 'skipped', '') or 'no replication policy'}"
            )
        t0 = time.monotonic()
        manifest, keys = gather_manifests(
            dict(rep.donor_addresses),
            policy.epoch,
            self.config.join_timeout_s,
            self.config.poll_interval_s,
        )
        t_manifest = time.monotonic()
        step = next(iter(keys.values()))[1]
        state = TrainingState.for_joiner(self.model, self.optimizer, manifest)
        neighbors = [Neighbor(d.id, d.prop_s, d.trans_s_per_byte, d.sync_s) for d in rep.donors
                     if d.id in keys]  # fmt: skip
        plan = plan_for_snapshot(state, rep, neighbors)
        stats = pull_state(
            plan,
            {d: a for d, a in rep.donor_addresses.items() if d in keys},
            state,
            {d: e for d, (e, _) in keys.items()},
            step,
            self.config.replication_timeout_s,
            neighbors=neighbors,
            config=PullConfig(window=self.config.pull_window),
        )
        t_pulled = time.monotonic()
        runtime = state.apply()
        self._step = runtime.step
        self._event(
            "replication_done",
            elapsed_s=time.monotonic() - t0,
            wait_donors_s=t_manifest - t0,
            transfer_s=t_pulled - t_manifest,
            planned_s=plan.makespan_s,
            lower_bound_s=lower_bound(state.total_bytes, neighbors),
            bytes=state.total_bytes,
            donors=stats.bytes_per_donor,
            replans=stats.replans,
            checksum_failures=stats.checksum_failures,
        )

    # ------------------------------------------------------------------ policy

    def _fetch_policy(self, timeout_s: float = 5.0) -> _Policy:
        reply = self._client.policy(timeout_s=timeout_s)
        self._fetched_epoch = max(self._fetched_epoch, reply.epoch)
        if self._watch is None and reply.notify_address and self.config.policy_notices:
            self._watch = PolicyWatch(reply.notify_address)
            self._watch.heard(reply, time.monotonic())  # no asking at every step until a notice
        return self._policy_of(reply)

    def _policy_of(self, reply: PolicyReply) -> _Policy:
        return _Policy(
            epoch=reply.epoch,
            topo_epoch=_topo_epoch(reply),
            members=tuple(reply.members if reply.sync is None else reply.sync.nodes),
            topology=_topology(reply, self.node_id),
            replication=reply.replication,
            paused=reply.paused,
            raw=reply,
        )

    def _newer_policy(self) -> str | None:
        """Interrupt check run while blocked in an allreduce.

        The round is abandoned when a peer already runs this step under a newer epoch (then no
        member can complete it), or when the daemon announces a policy that restarts the
        allreduce under a new structure (``restart_allreduce``: a link found down, a failed
        step). Without the second, a link that drops its packets without closing the connection
        would hold every member in the round until ``step_timeout_s``. A newer policy alone does
        not abort it: a planned change applies after the current allreduce, and a member may
        already have completed this round (a member that aborts then gets that result, see
        :attr:`~chaos.collectives.frames.Op.RESULT`).
        """
        mine = self._topo_epoch()
        seen = self._comm.newer_round_seen()
        if seen is not None and seen > mine:
            return f"a peer runs step {self._step} under epoch {seen} (this node: {mine})"
        restart = self._watch.restart(self._epoch) if self._watch is not None else None
        epoch = _topo_epoch(restart) if restart is not None else -1
        if epoch > mine:
            self._comm.note_newer_round(epoch)
            return f"the daemon restarts the allreduce under epoch {epoch}"
        return None

    def _topo_epoch(self) -> int:
        """The epoch of the installed data-plane structure (what this node's frames carry)."""
        topo = self._comm.topology
        return topo.epoch if topo is not None else -1

    def _wait_policy(self, ok: Callable[[_Policy], bool], timeout_s: float, what: str) -> _Policy:
        deadline = time.monotonic() + timeout_s
        last: _Policy | None = None
        while time.monotonic() < deadline:
            try:
                last = self._fetch_policy()
            except ChaosTimeout:
                continue
            if ok(last) and not last.paused:
                return last
            time.sleep(self.config.poll_interval_s)
        raise ChaosTimeout(f"timed out after {timeout_s} s waiting for {what}; last: {last}")

    def _install(self, policy: _Policy) -> None:
        """Installs a policy at a step boundary: sockets edited in place, donor role taken."""
        if policy.topology is None:
            raise ChaosError(f"the policy of epoch {policy.epoch} does not include {self.node_id}")
        if policy.topology != self._comm.topology:
            # an epoch that kept the structure (same topology epoch) leaves the sockets and any
            # round in flight alone
            self._comm.update_topology(policy.topology)
        changed = self._policy is None or set(policy.members) != set(self._policy.members)
        self._policy = policy
        self._epoch = policy.epoch
        if changed:
            self._event("membership", epoch=policy.epoch, members=list(policy.members))
        rep = policy.replication
        if rep is not None and rep.target != self.node_id and self.node_id in rep.donor_addresses:
            key = (policy.epoch, self._step)
            if self._published is None or self._published[1] != self._step:
                # A later epoch at the same step keeps the snapshot a joiner may be pulling.
                self._server.publish(self._capture_for_serving(self._step, policy.epoch), *key)
                self._published = key
                self._event("serving", joiner=rep.target, epoch=policy.epoch, step=self._step)

    def _refresh(self) -> None:
        """Installs a newer policy at this step boundary, if the daemon has one.

        A daemon that is slow to answer (a busy or starved device) is not fatal: training goes
        on under the current policy, until the daemon has been silent for ``policy_timeout_s``.

        Raises:
            TrainingStalled: no answer from the daemon for ``policy_timeout_s``.
        """
        if self._watch is not None:
            now = time.monotonic()
            if not self._watch.needs_fetch(self._epoch, now):
                self._last_contact = now  # it heard from the daemon, nothing newer
                return
            carried = self._watch.carried(max(self._epoch, self._fetched_epoch - 1))
            if carried is not None:  # the notice brought the policy: no round trip
                self._last_contact = now
                p = self._policy_of(carried)
                if p.topology is not None:
                    self._install(p)
                    return
        try:
            p = self._fetch_policy()
        except ChaosTimeout as exc:
            silent = time.monotonic() - self._last_contact
            if silent > self.config.policy_timeout_s:
                raise TrainingStalled(f"the daemon did not answer for {silent:.0f} s") from exc
            log.warning("daemon slow (%s); keeping the policy of epoch %d", exc, self._epoch)
            return
        self._last_contact = time.monotonic()
        if p.epoch > self._epoch and p.topology is not None and not p.paused:
            self._install(p)

    # ------------------------------------------------------------------ training

    def _capture(self, step: int) -> TrainingState:
        return TrainingState.capture(
            self.model, self.optimizer, step=step, epoch=max(0, self._epoch)
        )

    def _capture_for_serving(self, step: int, epoch: int) -> TrainingState:
        """The state a donor serves. Every donor must serve the same bytes, but each device's
        RNG stream is its own; so the RNG states handed to a joiner are a cluster-wide seed
        derived from the step, and this device's own RNG states are restored afterwards."""
        import random

        import numpy as np

        saved = (torch.get_rng_state(), random.getstate(), np.random.get_state())
        try:
            seed = 0x9E3779B97F4A7C15 ^ step
            torch.manual_seed(seed & 0xFFFFFFFF)
            random.seed(seed)
            np.random.seed(seed & 0xFFFFFFFF)
            return TrainingState.capture(self.model, self.optimizer, step=step, epoch=0)
        finally:
            torch.set_rng_state(saved[0])
            random.setstate(saved[1])
            np.random.set_state(saved[2])

    def _flat_grads(self) -> torch.Tensor:
        grads = [
            p.grad.detach() if p.grad is not None else torch.zeros_like(p) for p in self._params
        ]
        return ops.pack(grads)

    def update(self) -> None:
        """Averages the gradients over the members, then steps the optimizer.

        A failure or a membership change during the allreduce aborts it and reruns the step
        under the new policy; no partial result is ever applied.

        Raises:
            TrainingStalled: an allreduce failed and no new policy came in time.
        """
        flat = self._flat_grads()
        reduced = self._allreduce(flat)
        if reduced is not None:
            grads = [p.grad for p in self._params]
            for p, g in zip(self._params, grads, strict=True):
                if g is None:
                    p.grad = torch.zeros_like(p)
            ops.unpack(reduced, [p.grad for p in self._params])
        if self._published is not None:
            self._server.retire()  # the state is about to change
            self._published = None
        self.optimizer.step()
        self._step += 1
        self._maybe_reregister()

    def _allreduce(self, flat: torch.Tensor) -> torch.Tensor | None:
        while True:
            self._refresh()
            if self.world_size == 1:
                return None
            try:
                # keep_result: a member that never got this step's result (a member died while
                # it was going out) completes the step with it, so the survivors stay equal
                caught_up = self._comm.stats.caught_up
                out = self._comm.allreduce(flat, "mean", step=self._step, keep_result=True)
                if self._comm.stats.caught_up > caught_up:
                    self._event("caught_up", epoch=self._epoch, step=self._step)
                return out
            except RoundInterrupted as exc:
                self._event("restart", epoch=self._epoch, step=self._step, reason=str(exc))
                target = self._comm.newer_round_seen() or self._topo_epoch() + 1

                def reached(p: _Policy, target: int = target) -> bool:
                    return p.topo_epoch >= target and p.topology is not None

                self._install_newer(
                    self._wait_policy(
                        reached, self.config.policy_timeout_s, f"the policy of epoch {target}"
                    )
                )
            except PeerFailure as exc:
                self._event("allreduce_failed", epoch=self._epoch, step=self._step, peer=exc.peer)
                self._report_step_failed(exc.peer)
                failed = self._topo_epoch()  # the rerun needs a new structure epoch

                def renewed(p: _Policy, failed: int = failed) -> bool:
                    return p.topo_epoch > failed and p.topology is not None

                self._install_newer(
                    self._wait_policy(
                        renewed,
                        self.config.policy_timeout_s,
                        f"a new policy after {exc}",
                    )
                )

    def _install_newer(self, p: _Policy) -> None:
        """Installs the policy a wait after a failed round returned (the rerun needs exactly
        that structure or a later one, never an older one a notice may still carry)."""
        if p.epoch > self._epoch:
            self._install(p)

    def _report_step_failed(self, peer: str) -> None:
        """Tells the scheduler this node's step failed, so that a restart epoch comes even when
        nobody failed (e.g. a round that timed out); best effort."""
        try:
            self._client.trainer_event(
                "step_failed",
                detail=peer,
                epoch=self._epoch,
                timeout_s=min(2.0, self.config.policy_timeout_s),
            )
        except ChaosError as exc:
            log.debug("step_failed report not taken: %s", exc)

    def _maybe_reregister(self) -> None:
        """Adam creates its state on the first step: tell the scheduler the new layout."""
        sizes = None
        if self._layout is not None and len(self._layout) != self._state_tensor_count():
            sizes = self._capture(self._step).tensor_sizes()
        elif self._layout is None:
            sizes = self._capture(self._step).tensor_sizes()
        if sizes is not None and sizes != self._layout:
            self._layout = sizes
            self._client.register_trainer(
                data_address=self._comm.address,
                shard_address=self._server.address,
                has_state=True,
                tensor_sizes=sizes,
                timeout_s=5.0,
            )

    def _state_tensor_count(self) -> int:
        n = len(self.model.state_dict())
        for st in self.optimizer.state.values():
            n += sum(1 for v in st.values() if isinstance(v, torch.Tensor))
        return n + 1

    def fail_at(self, step: int, after_frames: int = 0) -> None:
        """Fault injection by name: this device dies (``kill -9``) mid-allreduce of ``step``.

        Once this process has sent ``after_frames + 1`` data frames of that step's allreduce, its
        embedded daemon is killed with SIGKILL and the process exits at once, with no cleanup:
        the cluster sees a node failure in the middle of a collective. For tests and emulation.

        Raises:
            ValueError: a negative step or frame count.
        """
        embedded = self._embedded
        self._comm.fail_at(step, after_frames, embedded.kill if embedded is not None else None)

    def check_state_replication(self) -> bool:
        """Serves this node's shards if the scheduler named it a donor for a joiner.

        Call it right after :meth:`update` (a step boundary). The shards are sent from a
        background thread while the script computes the next step's gradients; the next
        :meth:`update` cannot finish before the joiner has them all.

        Returns:
            True when this node is serving a joiner now.
        """
        self._refresh()
        return self._published is not None

    def request_node_exit(self, timeout_s: float = 15.0) -> None:
        """Leaves the cluster gracefully (scale-in), then releases every resource."""
        embedded = self._embedded
        try:
            self._client.leave(timeout_s=timeout_s, gone=embedded.exited if embedded else None)
            self._event("left", epoch=self._epoch, step=self._step)
        except DaemonGone as exc:  # the embedded daemon exited first (SIGHUP, or a failure)
            if embedded is not None and embedded.proc.returncode == 0:
                self._event("left", epoch=self._epoch, step=self._step)
            else:
                log.warning("leave request failed: %s", exc)
        except ChaosError as exc:
            log.warning("leave request failed: %s", exc)
        finally:
            if self._embedded is not None:
                self._embedded.wait_exit(timeout_s)
            self.close()

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """The full training state, for disk checkpoints (``torch.save``)."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "step": self._step,
            "epoch": self._epoch,
            "torch_rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Loads a state from :meth:`state_dict` (same model and optimizer layout).

        Raises:
            KeyError: a required entry is missing.
        """
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._step = int(state["step"])
        torch.set_rng_state(state["torch_rng"])

    # ------------------------------------------------------------------ misc

    def _event(self, kind: str, **fields: Any) -> None:
        rec = {"t": time.time(), "node": self.node_id, "event": kind, **fields}
        self.events.append(rec)
        log.info("%s %s", kind, fields)

    def iter_events(self) -> Iterator[dict[str, Any]]:
        """Membership and replication events seen so far, oldest first."""
        yield from self.events

    def close(self) -> None:
        """Closes the data plane and the daemon connection; stops an embedded daemon."""
        # a constructor that failed part way closes what it had opened, and only that
        names = ("_server", "_comm", "_client", "_watch")
        parts = [part for name in names if (part := getattr(self, name, None)) is not None]
        closers = [part.close for part in parts]
        for closer in closers:
            try:
                closer()
            except Exception as exc:  # noqa: BLE001 - best effort on shutdown
                log.debug("close: %s", exc)
        if self._embedded is not None:
            self._embedded.stop()
            self._embedded = None

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
