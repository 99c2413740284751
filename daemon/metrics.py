"""Prometheus metrics (prometheus-client), served only when ``--metrics-port`` is given.

Without a port every method is a cheap no-op, so the daemon never pays for metrics it does not
serve (the internal-error counts are kept either way, :attr:`Metrics.errors`). The endpoint binds
the daemon's listen host unless ``metrics_host`` names another.
"""

from __future__ import annotations

import logging

log = logging.getLogger("chaos.daemon.metrics")


class Metrics:
    """The daemon's metrics.

    Args:
        node_id: Value of the ``node`` label.
        port: HTTP port to serve ``/metrics`` on (``None``: metrics off).
        host: Address to bind it on (the daemon passes its listen host).

    Raises:
        OSError: the port cannot be bound.
    """

    def __init__(self, node_id: str, port: int | None, host: str = "127.0.0.1") -> None:
        self.enabled = port is not None
        self.errors: dict[str, int] = {}
        """Internal errors survived so far, by where they happened (``handler``, ``timer``...)."""
        if port is None:
            return
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Gauge,
            Histogram,
            start_http_server,
        )

        reg = CollectorRegistry()
        self._epoch = Gauge("chaos_epoch", "Membership epoch", ["node"], registry=reg)
        self._term = Gauge("chaos_term", "Election term", ["node"], registry=reg)
        self._members = Gauge("chaos_members", "Cluster members", ["node"], registry=reg)
        self._sched = Gauge("chaos_is_scheduler", "1 if scheduler", ["node"], registry=reg)
        self._paused = Gauge("chaos_paused", "1 if paused (no majority)", ["node"], registry=reg)
        self._msgs = Counter(
            "chaos_messages_total", "Messages received", ["node", "type"], registry=reg
        )
        self._refused = Counter(
            "chaos_refusals_total", "Frames refused or dropped", ["node", "reason"], registry=reg
        )
        self._prims = Histogram(
            "chaos_primitive_seconds",
            "Control-path completion of primitives",
            ["node", "primitive"],
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
            registry=reg,
        )
        self._errors = Counter(
            "chaos_internal_errors_total",
            "Exceptions caught in a handler, a timer or the loop (each one is a bug)",
            ["node", "where"],
            registry=reg,
        )
        self._node = node_id
        start_http_server(port, addr=host, registry=reg)
        log.info("metrics on %s:%d/metrics", host, port)

    def state(self, epoch: int, term: int, members: int, scheduler: bool, paused: bool) -> None:
        """Updates the gauges."""
        if not self.enabled:
            return
        n = self._node
        self._epoch.labels(n).set(epoch)
        self._term.labels(n).set(term)
        self._members.labels(n).set(members)
        self._sched.labels(n).set(1 if scheduler else 0)
        self._paused.labels(n).set(1 if paused else 0)

    def message(self, tag: str) -> None:
        """Counts one received message by type."""
        if self.enabled:
            self._msgs.labels(self._node, tag).inc()

    def refused(self, reason: str) -> None:
        """Counts one refused or dropped frame by reason."""
        if self.enabled:
            self._refused.labels(self._node, reason).inc()

    def error(self, where: str) -> None:
        """Counts one exception caught in ``where`` (``handler``, ``timer``, ``loop``)."""
        self.errors[where] = self.errors.get(where, 0) + 1
        if self.enabled:
            self._errors.labels(self._node, where).inc()

    def primitive(self, name: str, seconds: float) -> None:
        """Observes one primitive's control-path completion time."""
        if self.enabled:
            self._prims.labels(self._node, name).observe(seconds)
