"""``chaos-daemon dashboard``: a live, read-only web view of the cluster.

A poller asks a daemon for its ``status`` every ``interval_s`` (and, when that daemon is not the
scheduler, the scheduler too, whose status holds every training member's step and rate and the
joins in progress with their pulls). It lays the overlay out with networkx (a spring layout
seeded from the last one, so that the picture moves only where the cluster changed) and keeps
the result as one JSON document. A WSGI app served by waitress (:class:`MetricsServer`'s bounds)
answers ``GET /`` with the page (``static/index.html`` and its ``app.js``, which polls), ``GET
/api/cluster`` with the document, and nothing else.

Security: the page is read-only (it only asks for ``status``). It binds loopback unless told
otherwise, and only a keyed dashboard may bind another address. With a cluster key every request
must carry ``?token=`` (:func:`dashboard_token`, derived from the key, printed at start); the
document never holds key material (the nodes' public keys are left out too).
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

import msgspec
import networkx as nx
from chaos.daemon.client import DaemonClient
from chaos.daemon.metrics import MetricsServer, ServerLimits, _StartResponse, _WsgiApp

from chaos.errors import ChaosError, ConfigError
from chaos.protocol import StatusReply
from chaos.protocol.ids import check_daemon_endpoint, is_loopback_host
from chaos.security import ClusterKey, Security

log = logging.getLogger("chaos.daemon.dashboard")

_STATIC = resources.files("chaos.daemon") / "static"
PAGE = (_STATIC / "index.html").read_bytes()
"""The page (``daemon/static/index.html``): no third-party code, no external requests."""
SCRIPT = (_STATIC / "app.js").read_bytes()
"""Its script: polls ``/api/cluster`` every second and draws what it says with the DOM API
(escaped text, SVG elements at the positions the server computed)."""

__all__ = ["Dashboard", "DashboardConfig", "dashboard_token"]

_TOKEN_LABEL = b"chaos/v1/dashboard-token"
_SECRET_FIELDS = ("public_key", "data_key", "sign_key", "keys")
MAX_TIMELINE = 400


def dashboard_token(key: ClusterKey) -> str:
    """The token a keyed dashboard requires (``?token=``): HMAC-SHA256 of the cluster key over
    a fixed label, in hex; it reveals nothing of the key."""
    return key.derive(_TOKEN_LABEL).hex()


@dataclass(frozen=True)
class DashboardConfig:
    """The dashboard's settings (``chaos-daemon dashboard`` maps onto them one to one).

    Args:
        connect: The daemon to ask (``tcp://HOST:PORT``, or the local ``ipc://`` endpoint).
        host: Address the page binds (loopback by default; another only with ``key_file``).
        port: TCP port of the page (0: any free one).
        interval_s: Seconds between two polls of the daemons.
        key_file: The cluster key file (a keyed cluster: the token is derived from it).
        timeout_s: Longest wait for one daemon's answer.
    """

    connect: str
    host: str = "127.0.0.1"
    port: int = 8470
    interval_s: float = 1.0
    key_file: str | None = None
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        check_daemon_endpoint(self.connect)
        port = self.port
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError(f"port must be 0..65535, got {self.port!r}")
        for name in ("interval_s", "timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.05 <= v <= 3600:
                raise ConfigError(f"{name} must be 0.05..3600 seconds, got {v!r}")
        if self.key_file is None and not is_loopback_host(self.host):
            raise ConfigError(
                f"the dashboard binds {self.host}, not loopback: it needs a cluster key "
                "(--cluster-key), whose token every request must then carry"
            )


class ClusterPoller:
    """Asks the daemons for their status every interval and keeps the page's document.

    Args:
        cfg: The dashboard's settings.
        security: The cluster key's (or none).
    """

    def __init__(self, cfg: DashboardConfig, security: Security | None) -> None:
        self.cfg = cfg
        self._security = security
        self._lock = threading.Lock()
        self._doc: dict[str, Any] = {"ok": False, "error": "no answer yet", "polled_at": None}
        self._body = msgspec.json.encode(self._doc)
        self._pos: dict[str, tuple[float, float]] = {}
        self._timeline: dict[tuple[float, str, str], dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-dashboard", daemon=True)

    def start(self) -> None:
        """Starts polling in a background thread."""
        self._thread.start()

    def document(self) -> dict[str, Any]:
        """The page's latest document."""
        with self._lock:
            return self._doc

    def body(self) -> bytes:
        """The page's latest document, as JSON."""
        with self._lock:
            return self._body

    def poll_once(self) -> None:
        """Asks the daemons once and replaces the document (an error document on failure)."""
        try:
            doc = self._build()
            body = msgspec.json.encode(doc)
        except (ChaosError, OSError) as exc:  # the daemon is down, unreachable, refuses
            doc = {"ok": False, "error": str(exc)[:500], "polled_at": time.time()}
            body = msgspec.json.encode(doc)
            log.warning("dashboard: %s", exc)
        except Exception as exc:  # noqa: BLE001 - a bug here must not end the polling
            log.exception("dashboard: building the page's document failed")
            doc = {"ok": False, "error": f"internal error: {exc!r}"[:500], "polled_at": time.time()}
            body = msgspec.json.encode(doc)
        with self._lock:
            self._doc, self._body = doc, body

    def close(self, timeout_s: float = 5.0) -> None:
        """Stops polling."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.cfg.interval_s)

    def _status(self, endpoint: str) -> StatusReply:
        with DaemonClient(endpoint, self.cfg.timeout_s, security=self._security) as c:
            return c.status(timeout_s=self.cfg.timeout_s)

    def _build(self) -> dict[str, Any]:
        here = self._status(self.cfg.connect)
        sched = here
        if here.scheduler is not None and here.scheduler != here.node_id:
            addr = next((n.address for n in here.nodes if n.id == here.scheduler), None)
            if addr is not None:
                try:
                    sched = self._status(addr)
                except (ChaosError, OSError) as exc:  # its view is still shown
                    log.info("dashboard: the scheduler %s at %s: %s", here.scheduler, addr, exc)
        for st in (here, sched):
            for e in st.events:
                key = (e.ts, e.node, e.event)
                self._timeline[key] = msgspec.to_builtins(e)
        if len(self._timeline) > MAX_TIMELINE:
            for key in sorted(self._timeline)[: len(self._timeline) - MAX_TIMELINE]:
                del self._timeline[key]
        return {
            "ok": True,
            "polled_at": time.time(),
            "asked": here.node_id,
            "from_scheduler": sched.node_id == sched.scheduler,
            "status": _public(msgspec.to_builtins(sched)),
            "positions": self._layout(sched),
            "timeline": [self._timeline[k] for k in sorted(self._timeline)],
        }

    def _layout(self, st: StatusReply) -> dict[str, list[float]]:
        """Node positions in [0, 1] x [0, 1]: a seeded spring layout started from the last."""
        g = nx.Graph()
        g.add_nodes_from(sorted(n.id for n in st.nodes))
        g.add_edges_from((x.a, x.b) for x in st.links if x.a in g and x.b in g)
        if not g:
            return {}
        start = {n: self._pos[n] for n in g if n in self._pos} or None
        pos = nx.spring_layout(g, pos=start, seed=0, iterations=30 if start else 100)
        xs = [float(p[0]) for p in pos.values()]
        ys = [float(p[1]) for p in pos.values()]
        span_x, span_y = (max(xs) - min(xs)) or 1.0, (max(ys) - min(ys)) or 1.0
        self._pos = {n: (float(p[0]), float(p[1])) for n, p in pos.items()}
        x0, y0 = min(xs), min(ys)
        return {n: [0.08 + 0.84 * (float(p[0]) - x0) / span_x,
                    0.08 + 0.84 * (float(p[1]) - y0) / span_y] for n, p in pos.items()}  # fmt: skip


def _public(doc: Any) -> Any:
    """``doc`` without key material (the nodes' and trainers' public keys)."""
    if isinstance(doc, dict):
        return {k: _public(v) for k, v in doc.items() if k not in _SECRET_FIELDS}
    if isinstance(doc, list):
        return [_public(v) for v in doc]
    return doc


def dashboard_app(poller: ClusterPoller, token: str | None) -> _WsgiApp:
    """The page's WSGI app: ``GET /``, ``/app.js`` and ``/api/cluster`` only; with a ``token``,
    every request must carry it as ``?token=`` (compared in constant time)."""

    def app(environ: dict[str, Any], start_response: _StartResponse) -> Iterable[bytes]:
        method, path = environ.get("REQUEST_METHOD", "GET"), environ.get("PATH_INFO", "/")
        if method not in ("GET", "HEAD"):
            return _answer(start_response, "405 Method Not Allowed", "text/plain", b"read-only\n")
        if token is not None:
            given = parse_qs(environ.get("QUERY_STRING", "")).get("token", [""])[0]
            if not hmac.compare_digest(given.encode(), token.encode()):
                return _answer(start_response, "401 Unauthorized", "text/plain",
                               b"this dashboard needs ?token= (chaos-daemon dashboard prints it)\n")
        if path == "/":  # its script is asked for with the same token
            page = PAGE if token is None else PAGE.replace(
                b'src="app.js"', f'src="app.js?token={token}"'.encode())  # fmt: skip
            return _answer(start_response, "200 OK", "text/html; charset=utf-8", page)
        if path == "/app.js":
            return _answer(start_response, "200 OK", "text/javascript; charset=utf-8", SCRIPT)
        if path == "/api/cluster":
            return _answer(start_response, "200 OK", "application/json", poller.body())
        return _answer(start_response, "404 Not Found", "text/plain", b"not found\n")

    return app


def _answer(start_response: _StartResponse, status: str, ctype: str,
            body: bytes) -> list[bytes]:  # fmt: skip
    start_response(status, [
        ("Content-Type", ctype), ("Content-Length", str(len(body))),
        ("Cache-Control", "no-store"), ("X-Content-Type-Options", "nosniff"),
        ("Content-Security-Policy",
         "default-src 'none'; script-src 'self'; connect-src 'self'; style-src 'unsafe-inline'; "
         "img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
        ("Referrer-Policy", "no-referrer"),
    ])  # fmt: skip
    return [body]


class Dashboard:
    """The poller and the page's server, started at once.

    Args:
        cfg: The settings.

    Raises:
        ConfigError: the key file cannot be read.
        OSError: the page's address cannot be bound.
    """

    def __init__(self, cfg: DashboardConfig) -> None:
        key = ClusterKey.load(cfg.key_file) if cfg.key_file is not None else None
        security = Security.from_key_file(cfg.key_file) if key is not None else None
        self.token = dashboard_token(key) if key is not None else None
        self.poller = ClusterPoller(cfg, security)
        self.poller.poll_once()
        self._server = MetricsServer(dashboard_app(self.poller, self.token), cfg.host, cfg.port,
                                     ServerLimits(max_connections=32, threads=4))  # fmt: skip
        self.port: int = self._server.port
        self.poller.start()
        query = f"?token={self.token}" if self.token else ""
        host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
        self.url = f"http://{host}:{self.port}/{query}"

    def close(self) -> None:
        """Stops polling and serving."""
        self.poller.close()
        self._server.close()
