"""Prometheus metrics (prometheus-client), served only when ``--metrics-port`` is given.

Without a port every method is a cheap no-op, so the daemon never pays for metrics it does not
serve (the internal-error counts are kept either way, :attr:`Metrics.errors`).

The endpoint (:class:`MetricsServer`) is waitress running prometheus-client's WSGI app on a
daemon thread, with bounds: at most ``max_connections`` connections open at once (more wait in
the kernel's accept queue, holding no descriptor or thread of the daemon), a fixed pool of
``threads`` worker threads, and a connection idle for ``idle_timeout_s`` closed. Only
``/metrics`` is served (any other path: 404). A keyed daemon requires
``Authorization: Bearer <token>``, the token being :func:`metrics_token` of the cluster key
(``chaos-daemon metrics-token``; anything else: 401). The endpoint binds loopback unless
``metrics_host`` names another address, which only a keyed daemon may (the config refuses it
otherwise).
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from chaos.security import ClusterKey

log = logging.getLogger("chaos.daemon.metrics")

METRICS_PATH = "/metrics"
"""The one path the endpoint serves."""
_TOKEN_LABEL = b"chaos/v1/metrics-bearer-token"
_STOP_TIMEOUT_S = 5.0

_StartResponse = Callable[..., Any]
_WsgiApp = Callable[[dict[str, Any], _StartResponse], Iterable[bytes]]


def metrics_token(key: ClusterKey) -> str:
    """The bearer token a keyed daemon's metrics endpoint requires.

    It is HMAC-SHA256 of the cluster key over a fixed label, in hex: every daemon of the
    cluster expects the same token, and the token reveals nothing of the key (nor of the CURVE
    keys derived from it under other labels).

    Args:
        key: The cluster key.

    Returns:
        64 lowercase hex digits.
    """
    return key.derive(_TOKEN_LABEL).hex()


def _plain(start_response: _StartResponse, status: str, body: str,
           extra: tuple[tuple[str, str], ...] = ()) -> list[bytes]:  # fmt: skip
    data = body.encode()
    headers = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data)))]
    start_response(status, headers + list(extra))
    return [data]


def guarded_app(inner: _WsgiApp, token: str | None) -> _WsgiApp:
    """Wraps the metrics WSGI app: only ``GET``/``HEAD`` of :data:`METRICS_PATH`, and with a
    ``token`` only with ``Authorization: Bearer <token>`` (compared in constant time).

    Args:
        inner: prometheus-client's WSGI app.
        token: The bearer token required (``None``: none, an unkeyed loopback daemon).

    Returns:
        The WSGI app to serve: 404 for another path, 405 for another method, 401 (with
        ``WWW-Authenticate: Bearer``) for a missing or wrong token.
    """
    expected = None if token is None else f"Bearer {token}".encode("latin-1")

    def app(environ: dict[str, Any], start_response: _StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != METRICS_PATH:
            return _plain(start_response, "404 Not Found", f"only {METRICS_PATH} is served\n")
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            return _plain(start_response, "405 Method Not Allowed", "GET only\n",
                          (("Allow", "GET, HEAD"),))  # fmt: skip
        if expected is not None:
            given = str(environ.get("HTTP_AUTHORIZATION", "")).encode("latin-1", "replace")
            if not hmac.compare_digest(given, expected):
                return _plain(start_response, "401 Unauthorized", "bearer token required\n",
                              (("WWW-Authenticate", 'Bearer realm="chaos-metrics"'),))  # fmt: skip
        return inner(environ, start_response)

    return app


@dataclass(frozen=True)
class ServerLimits:
    """The metrics endpoint's bounds (``DaemonConfig`` checks the values).

    Attributes:
        max_connections: Most connections open at once (waitress ``connection_limit``).
        idle_timeout_s: A connection without a request in progress idle this long is closed
            (waitress ``channel_timeout``, whole seconds).
        threads: Worker threads answering requests.
    """

    max_connections: int = 32
    idle_timeout_s: float = 10.0
    threads: int = 2


def _bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (the first address ``host`` resolves to).

    Raises:
        OSError: ``host`` does not resolve, or the address cannot be bound.
    """
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    return socket.create_server(addr, family=family)


class MetricsServer:
    """waitress serving ``app`` on ``host:port`` from a daemon thread (started at once).

    Args:
        app: The WSGI app.
        host: Address to bind.
        port: TCP port to bind.
        limits: Connection bounds and idle timeout.

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, app: _WsgiApp, host: str, port: int, limits: ServerLimits) -> None:
        from waitress.server import create_server

        sock = _bind(host, port)  # first: a failed bind leaves no thread or pipe behind
        self._map: dict[int, Any] = {}
        try:
            self._server: Any = create_server(
                app,
                map=self._map,
                sockets=[sock],
                threads=limits.threads,
                connection_limit=limits.max_connections,
                channel_timeout=int(limits.idle_timeout_s),
                cleanup_interval=1,  # idle connections are looked for every second
                ident="chaos",
            )
        except BaseException:
            sock.close()
            raise
        self._closed = False
        self.port: int = sock.getsockname()[1]
        """The bound port (the one asked for, or the one the system chose for 0)."""
        self._thread = threading.Thread(
            target=self._server.run, name="chaos-metrics", daemon=True
        )
        self._thread.start()

    def close(self, timeout_s: float = _STOP_TIMEOUT_S) -> bool:
        """Closes the listening socket and every connection, then stops the threads.

        The sockets are closed on the server's own thread (a thunk its loop runs), so nothing
        races its ``select``; the loop then ends with its map empty. Idempotent.

        Args:
            timeout_s: Bound of each wait: the loop thread's join, then the workers'.

        Returns:
            Whether every thread stopped within the bound (a straggler is a daemon thread:
            it never holds up the process's exit).
        """
        if self._closed:
            return not self._thread.is_alive()
        self._closed = True
        from waitress import wasyncore
        from waitress.trigger import trigger

        socket_map = self._map
        pull = next((d for d in list(socket_map.values()) if isinstance(d, trigger)), None)
        if pull is not None and self._thread.is_alive():
            pull.pull_trigger(lambda: wasyncore.close_all(socket_map))
        else:  # the loop is gone: nothing races these closes
            wasyncore.close_all(socket_map)
        self._thread.join(timeout_s)
        dispatcher = self._server.task_dispatcher
        workers = bool(dispatcher.shutdown(cancel_pending=True, timeout=timeout_s))
        stopped = workers and not self._thread.is_alive()
        if not stopped:
            log.warning("the metrics server did not stop within %.1f s", timeout_s)
        return stopped


class Metrics:
    """The daemon's metrics.

    Args:
        node_id: Value of the ``node`` label.
        port: HTTP port to serve ``/metrics`` on (``None``: metrics off).
        host: Address to bind it on (the daemon passes ``resolved_metrics_host``).
        token: Bearer token every request must carry (:func:`metrics_token`; ``None``: none).
        limits: The endpoint's connection bounds and idle timeout.

    Raises:
        OSError: the port cannot be bound.
    """

    def __init__(
        self,
        node_id: str,
        port: int | None,
        host: str = "127.0.0.1",
        *,
        token: str | None = None,
        limits: ServerLimits | None = None,
    ) -> None:
        self.enabled = port is not None
        self.errors: dict[str, int] = {}
        """Internal errors survived so far, by where they happened (``handler``, ``timer``...)."""
        self.server: MetricsServer | None = None
        """The HTTP endpoint (``None``: metrics off)."""
        if port is None:
            return
        from prometheus_client import (
            CollectorRegistry,
            Counter,
            Gauge,
            Histogram,
            make_wsgi_app,
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
        app = guarded_app(make_wsgi_app(reg), token)
        self.server = MetricsServer(app, host, port, limits or ServerLimits())
        log.info("metrics on %s:%d%s%s", host, port, METRICS_PATH,
                 " (bearer token required)" if token is not None else "")  # fmt: skip

    def close(self, timeout_s: float = _STOP_TIMEOUT_S) -> bool:
        """Stops the HTTP endpoint (no-op when metrics are off; idempotent).

        Returns:
            Whether its threads stopped within ``timeout_s`` (see :meth:`MetricsServer.close`).
        """
        return True if self.server is None else self.server.close(timeout_s)

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
