"""How a :class:`~chaos.trainer.trainer.Trainer` builds its collaborators from its config: the
embedded daemon, the session with the local daemon, the data plane and the donor.

Internal to :mod:`chaos.trainer`; each function maps :class:`TrainerConfig` fields onto one
collaborator's arguments, so that the trainer's own module keeps to training.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from chaos.collectives.config import DEFAULT_MAX_EARLY_BYTES
from chaos.launch import free_tcp_address
from chaos.security import Security
from chaos.trainer.config import TrainerConfig
from chaos.trainer.dataplane import DataPlane
from chaos.trainer.donor import Donor
from chaos.trainer.embedded import EmbeddedDaemon
from chaos.trainer.pull_progress import Listener
from chaos.trainer.session import DaemonSession, StepBeacon

__all__ = ["connect_session", "embedded_args", "make_donor", "open_data_plane", "start_embedded"]


def embedded_args(cfg: TrainerConfig) -> tuple[str, ...]:
    """The embedded daemon's ``chaos-daemon start`` arguments beyond its id, address and
    contacts: its join timeout is the trainer's, so it tries its contacts (some may be cut off
    or paused for a while) for as long as the trainer waits; ``cfg.daemon_args`` come last, and
    a ``--join-timeout`` among them wins."""
    return ("--join-timeout", str(cfg.join_timeout_s), *cfg.daemon_args)


def start_embedded(node_id: str, cfg: TrainerConfig, join: str | None,
                   listen: str | None) -> EmbeddedDaemon:  # fmt: skip
    """Starts the node's own daemon (joining ``join``, or a new cluster) and returns it once it
    is a member.

    Raises:
        DaemonStartError: it exited or was not a member within ``join_timeout_s``.
    """
    embedded = EmbeddedDaemon(
        node_id,
        listen or free_tcp_address(cfg.data_host),
        join,
        embedded_args(cfg),
        cfg.daemon_dir,
        cluster_key=cfg.cluster_key,
    )
    try:
        embedded.wait_ready(cfg.join_timeout_s)
    except BaseException:
        embedded.stop(timeout_s=2.0)
        raise
    return embedded


def connect_session(address: str, node_id: str, cfg: TrainerConfig, security: Security,
                    t0: float) -> DaemonSession:  # fmt: skip
    """The session with the local daemon at ``address`` (``t0``: when the trainer started)."""
    from chaos.daemon.client import DaemonClient

    # the step progress goes to a local daemon only (a stopped trainer is found from it)
    beacon = StepBeacon(address) if address.startswith("ipc://") else None
    return DaemonSession(
        DaemonClient(address, timeout_s=5.0, security=security),
        node_id,
        poll_interval_s=cfg.poll_interval_s,
        policy_timeout_s=cfg.policy_timeout_s,
        policy_notices=cfg.policy_notices,
        contact_since=t0,
        beacon=beacon,
    )


def open_data_plane(node_id: str, cfg: TrainerConfig, security: Security,
                    interrupt: Callable[[], str | None],
                    model: torch.nn.Module | None = None) -> DataPlane:  # fmt: skip
    """The allreduce communicator and the shard server, on ephemeral ports or in
    ``data_ports``; ``interrupt`` is checked while a round blocks; ``model``'s gradient size
    sets the default bound on frames kept for a later round (see :func:`early_bytes_bound`)."""
    return DataPlane(
        node_id,
        cfg.data_host,
        chunk_bytes=cfg.chunk_bytes,
        step_timeout_s=cfg.step_timeout_s,
        wire_dtype=cfg.wire_dtype,
        lanes=cfg.lanes,
        poll_interval_s=cfg.poll_interval_s,
        interrupt=interrupt,
        ports=cfg.data_ports,
        security=security,
        max_early_bytes=early_bytes_bound(cfg, 0 if model is None else gradient_bytes(model)),
    )


def early_bytes_bound(cfg: TrainerConfig, grad_bytes: int) -> int:
    """:attr:`TrainerConfig.max_early_bytes`, or by default four times ``grad_bytes`` (the
    model's gradient in float32), at least 256 MiB."""
    if cfg.max_early_bytes is not None:
        return cfg.max_early_bytes
    return max(DEFAULT_MAX_EARLY_BYTES, 4 * grad_bytes)


def gradient_bytes(model: torch.nn.Module) -> int:
    """The bytes of ``model``'s gradient in float32 (its trainable parameters)."""
    return 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)


def make_donor(model: torch.nn.Module, optimizer: torch.optim.Optimizer, node_id: str,
               plane: DataPlane, cfg: TrainerConfig, security: Security,
               event: Callable[..., None], extra: dict[str, Any],
               pull_listener: Listener | None = None) -> Donor:  # fmt: skip
    """The state's capture, serving (through ``plane``'s shard server) and pull."""
    return Donor(
        model,
        optimizer,
        node_id,
        plane,
        event,
        join_timeout_s=cfg.join_timeout_s,
        poll_interval_s=cfg.poll_interval_s,
        replication_timeout_s=cfg.replication_timeout_s,
        pull_window=cfg.pull_window,
        progress_interval_s=cfg.pull_progress_s,
        pull_listener=pull_listener,
        catch_up_log_bytes=cfg.catch_up_log_bytes,
        security=security,
        extra=extra,
    )
