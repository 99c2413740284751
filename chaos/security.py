"""Cluster keys, node keypairs and the ZeroMQ CURVE settings every Chaos socket uses.

The model (``docs/security.md`` has the reasoning and the threat model):

* A **cluster key** is 32 random bytes in a file (``chaos-daemon keygen FILE``, mode 0600). Every
  holder of the file may join the cluster.
* Every server socket (a daemon's ROUTER, a trainer's data ROUTER, a donor's shard server) is a
  CURVE server whose long-term keypair is *derived* from the cluster key. A client must know that
  server public key to complete the CURVE handshake, and only key holders can derive it (it is
  never sent on the wire), so a stranger's connection fails in the handshake, before one message
  is read. The handshake also proves to the client that the server holds the key.
* Every process also has its **own** CURVE keypair, used as the client key of its connections.
  The server learns the client's public key from the handshake (ZAP, as the frame's ``User-Id``)
  and binds a node id to it at admission, so one key holder cannot send as another.
* Everything after the handshake is encrypted and authenticated by CURVE; the raw TCP payload
  lanes use AES-256-GCM with a fresh key sent inside the (encrypted) lane offer.

Without a cluster key (:attr:`Security.enabled` is ``False``) sockets are plain; the daemon
allows that only on loopback unless started with ``--insecure``.

A refused handshake does not show on the socket itself, only on its ZeroMQ socket monitor:
:class:`HandshakeWatch` opens that monitor with :data:`HANDSHAKE_FAILED_EVENTS`, receives its
events without blocking, counts them and hands the first few (then every so many) to the caller
to log, so a stranger reconnecting in a loop cannot flood the log. The daemon's transport and
client, the collectives' data endpoint and the replication shard server use it; monitors that
also follow other events (a link's connect and disconnect, a donor's) share the mask and
:func:`handshake_error`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from chaos.errors import ConfigError

__all__ = [
    "CLUSTER_KEY_BYTES", "HANDSHAKE_FAILED_EVENTS", "ClusterKey", "HandshakeRefusal",
    "HandshakeWatch", "Keypair", "Security", "authenticated_key", "handshake_error",
]  # fmt: skip

CLUSTER_KEY_BYTES = 32
_HEADER = "# chaos cluster key v1"
_LABEL_SERVER = b"chaos/v1/curve-server"
_LABEL_FINGERPRINT = b"chaos/v1/fingerprint"
ZAP_DOMAIN = "chaos"
"""The ZAP domain of every Chaos CURVE server socket."""


@dataclass(frozen=True, repr=False)
class ClusterKey:
    """A cluster's shared secret.

    Attributes:
        secret: The 32 key bytes.
        path: The file it was read from (``None``: generated in memory).
    """

    secret: bytes
    path: Path | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.secret, bytes) or len(self.secret) != CLUSTER_KEY_BYTES:
            raise ConfigError(f"a cluster key is {CLUSTER_KEY_BYTES} bytes")

    def __repr__(self) -> str:  # never print the secret
        return f"ClusterKey(fingerprint={self.fingerprint()!r}, path={self.path!r})"

    @classmethod
    def generate(cls) -> ClusterKey:
        """A new random cluster key."""
        return cls(secrets.token_bytes(CLUSTER_KEY_BYTES))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ClusterKey:
        """Reads a key file written by :meth:`write`.

        Raises:
            ConfigError: the file is missing, a symlink, readable by others (group or world
                permission bits set), or not a cluster key.
        """
        p = Path(path)
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise ConfigError(f"cluster key file {p} does not exist "
                              "(create one with 'chaos-daemon keygen FILE')") from None  # fmt: skip
        except OSError as exc:
            raise ConfigError(f"cannot open cluster key file {p}: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"cluster key file {p} is not a regular file")
            if st.st_mode & 0o077:
                mode = stat.S_IMODE(st.st_mode)
                raise ConfigError(
                    f"cluster key file {p} is readable by others (mode {mode:o}); "
                    f"run 'chmod 600 {p}'"
                )
            raw = os.read(fd, 4096)
        finally:
            os.close(fd)
        lines = [ln.strip() for ln in raw.decode("ascii", "replace").splitlines() if ln.strip()]
        body = [ln for ln in lines if not ln.startswith("#")]
        if not lines or lines[0] != _HEADER or len(body) != 1:
            raise ConfigError(f"{p} is not a chaos cluster key file")
        try:
            secret = bytes.fromhex(body[0])
        except ValueError:
            raise ConfigError(f"{p} is not a chaos cluster key file (bad hex)") from None
        if len(secret) != CLUSTER_KEY_BYTES:
            raise ConfigError(f"{p}: a cluster key is {CLUSTER_KEY_BYTES} bytes")
        return cls(secret, p)

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Writes the key to a new file with mode 0600.

        Raises:
            ConfigError: the file exists already (a key is never overwritten) or cannot be
                created.
        """
        p = Path(path)
        text = f"{_HEADER}\n{self.secret.hex()}\n".encode()
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            raise ConfigError(f"{p} exists already; a cluster key is never overwritten") from None
        except OSError as exc:
            raise ConfigError(f"cannot create {p}: {exc.strerror}") from exc
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, text)
        finally:
            os.close(fd)
        return p

    def derive(self, label: bytes) -> bytes:
        """32 bytes derived from the key for one purpose (HMAC-SHA256 of ``label``)."""
        return hmac.new(self.secret, label, hashlib.sha256).digest()

    def fingerprint(self) -> str:
        """A short public identifier of the key (for logs and status; reveals nothing)."""
        return self.derive(_LABEL_FINGERPRINT).hex()[:16]

    def server_keypair(self) -> Keypair:
        """The CURVE keypair every server socket of this cluster uses."""
        secret = zmq.utils.z85.encode(self.derive(_LABEL_SERVER))
        return Keypair(zmq.curve_public(secret), secret)


@dataclass(frozen=True, repr=False)
class Keypair:
    """A CURVE keypair, both halves Z85-encoded (40 bytes each)."""

    public: bytes
    secret: bytes

    def __repr__(self) -> str:
        return f"Keypair(public={self.public.decode()!r})"

    @classmethod
    def generate(cls) -> Keypair:
        """A fresh random keypair."""
        public, secret = zmq.curve_keypair()
        return cls(public, secret)


_auth_lock = threading.Lock()


@dataclass(frozen=True)
class Security:
    """One process's security settings: the cluster key and its own keypair.

    Build one with :meth:`from_key_file` (``None``: no key, plain sockets) and hand it to every
    component that opens sockets.

    Attributes:
        cluster: The cluster key, or ``None`` (insecure: no authentication, no encryption).
        keys: This process's own CURVE keypair (its identity as a client).
    """

    cluster: ClusterKey | None = None
    keys: Keypair = field(default_factory=Keypair.generate)
    _server: Keypair | None = field(default=None, init=False, repr=False, compare=False)
    _auths: dict[int, ThreadAuthenticator] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if self.cluster is not None:
            object.__setattr__(self, "_server", self.cluster.server_keypair())

    @classmethod
    def from_key_file(cls, path: str | os.PathLike[str] | None) -> Security:
        """Security from a cluster key file (``None``: insecure).

        Raises:
            ConfigError: see :meth:`ClusterKey.load`.
        """
        return cls(None if path is None else ClusterKey.load(path))

    @property
    def enabled(self) -> bool:
        """Whether sockets authenticate and encrypt (a cluster key is set)."""
        return self.cluster is not None

    @property
    def public_key(self) -> str:
        """This process's public key as text (what peers see as its ``User-Id``)."""
        return self.keys.public.decode("ascii")

    def server(self, sock: zmq.Socket[bytes]) -> None:
        """Makes ``sock`` (before ``bind``) a CURVE server of the cluster; no-op when insecure.

        The socket's context must have an authenticator (:meth:`authenticate`) so frames carry
        the client's public key.
        """
        if self._server is None:
            return
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        sock.curve_secretkey = self._server.secret
        sock.curve_publickey = self._server.public
        sock.curve_server = True

    def client(self, sock: zmq.Socket[bytes]) -> None:
        """Makes ``sock`` (before ``connect``) a CURVE client of the cluster; no-op when
        insecure."""
        if self._server is None:
            return
        sock.curve_serverkey = self._server.public
        sock.curve_publickey = self.keys.public
        sock.curve_secretkey = self.keys.secret

    def authenticate(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        """Starts the ZAP handler of ``ctx`` once (no-op when insecure).

        Every client that completes the CURVE handshake holds the cluster key; the handler
        accepts it and tags its frames with its public key (``User-Id``). Stop it with
        :meth:`release` before terminating the context.
        """
        if self._server is None:
            return
        with _auth_lock:
            if id(ctx) in self._auths:
                return
            auth = ThreadAuthenticator(ctx, log=_quiet_log())
            auth.start()
            auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
            self._auths[id(ctx)] = auth

    def release(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        """Stops the ZAP handler :meth:`authenticate` started for ``ctx`` (no-op if none)."""
        with _auth_lock:
            auth = self._auths.pop(id(ctx), None)
        if auth is not None:
            auth.stop()


def authenticated_key(frame: zmq.Frame) -> str | None:
    """The CURVE public key (Z85 text) of the peer that sent ``frame``, or ``None`` when its
    connection is not authenticated (insecure or IPC)."""
    try:
        user = frame.get("User-Id")
    except (zmq.ZMQError, KeyError, UnicodeDecodeError):
        return None
    return user if isinstance(user, str) and len(user) == 40 else None


def _quiet_log() -> object:
    import logging

    return logging.getLogger("chaos.security.zap")


# ----------------------------------------------------------------------------- handshakes

HANDSHAKE_FAILED_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                           | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                           | zmq.EVENT_HANDSHAKE_FAILED_AUTH)  # fmt: skip
"""The monitor event mask of a failed handshake (of any kind)."""

_ERRORS: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no detail",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "authentication",
}


def handshake_error(event: int) -> str | None:
    """The kind of a failed-handshake monitor event (``"protocol"``...), ``None`` for another
    event."""
    return _ERRORS.get(int(event))


@dataclass(frozen=True)
class HandshakeRefusal:
    """One failed handshake a :class:`HandshakeWatch` received.

    Attributes:
        count: How many the watch has received so far, this one included.
        endpoint: The endpoint the monitor names (this socket's own for a server).
        detail: The kind of failure (``"no detail"``, ``"protocol"``, ``"authentication"``).
    """

    count: int
    endpoint: str
    detail: str


class HandshakeWatch:
    """The monitor of one socket's failed CURVE handshakes.

    Open it before the socket binds or connects (a mechanism mismatch fails the first handshake
    only: ZeroMQ does not retry it), and :meth:`close` it before the socket.

    Args:
        sock: The socket to watch.
        on_refused: Called with every refusal received (e.g. to count it in the caller's stats).
        report: Called with the refusals to log: the first ``log_first``, then every
            ``log_every``-th (none after the first ones when ``log_every`` is 0).
        log_first: How many refusals are reported one by one.
        log_every: After those, report every this many (0: never).

    Attributes:
        monitor: The monitor socket (register it with a poller for ``POLLIN``).
        failures: The refusals received so far.
    """

    def __init__(
        self,
        sock: zmq.Socket[Any],
        *,
        on_refused: Callable[[HandshakeRefusal], object] | None = None,
        report: Callable[[HandshakeRefusal], object] | None = None,
        log_first: int = 0,
        log_every: int = 0,
    ) -> None:
        if log_first < 0 or log_every < 0:
            raise ValueError(f"log_first and log_every must be >= 0, got {log_first}, {log_every}")
        self._sock = sock
        self.monitor: zmq.Socket[Any] = sock.get_monitor_socket(HANDSHAKE_FAILED_EVENTS)
        self.failures = 0
        self._on_refused = on_refused
        self._report = report
        self._log_first = log_first
        self._log_every = log_every

    def pending(self) -> bool:
        """Whether a refusal is waiting to be received (nothing is received)."""
        return bool(self.monitor.poll(0, zmq.POLLIN))

    def take(self) -> HandshakeRefusal | None:
        """Receives one waiting refusal without blocking (``None``: none waits); counts it,
        passes it to ``on_refused`` and, within the log limits, to ``report``."""
        try:
            event = recv_monitor_message(self.monitor, flags=zmq.NOBLOCK)
        except zmq.Again:
            return None
        self.failures += 1
        endpoint = event.get("endpoint", b"")
        where = endpoint.decode(errors="replace") if isinstance(endpoint, bytes) else endpoint
        refusal = HandshakeRefusal(
            self.failures, str(where), handshake_error(int(event["event"])) or "error"
        )
        if self._on_refused is not None:
            self._on_refused(refusal)
        if self._report is not None and self.logs(refusal.count):
            self._report(refusal)
        return refusal

    def logs(self, count: int) -> bool:
        """Whether the ``count``-th refusal is reported (the first ones, then every Mth)."""
        if count <= self._log_first:
            return True
        return self._log_every > 0 and count % self._log_every == 0

    def drain(self, limit: int | None = None) -> int:
        """Receives the waiting refusals (at most ``limit``) without blocking; how many."""
        n = 0
        while (limit is None or n < limit) and self.take() is not None:
            n += 1
        return n

    def close(self) -> None:
        """Stops monitoring the socket and closes the monitor (the socket stays open)."""
        self._sock.disable_monitor()
        self.monitor.close(linger=0)
