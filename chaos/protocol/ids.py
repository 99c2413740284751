"""Node ids and endpoints: the one place their rules are written.

A node id is 1 to 64 characters of ``A-Za-z0-9_.:-``; the daemon's CLI, its config, the wire
schemas and the Trainer's default id all take the rule from here. Endpoints are
``tcp://HOST:PORT`` (a daemon's peers, a trainer's data plane) or ``ipc://PATH`` (a local
daemon's socket, a data plane on one host).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated

import msgspec

from chaos.errors import ConfigError

NODE_ID_CHARS = "A-Za-z0-9_.:-"
"""The characters a node id may hold (a regular-expression character class body)."""

NODE_ID_MAX_LEN = 64
"""The longest node id."""

NODE_ID_RULE = f"1-{NODE_ID_MAX_LEN} characters of {NODE_ID_CHARS}"
"""The rule in words, for help texts and error messages."""

_NODE_ID_RE = re.compile(f"^[{NODE_ID_CHARS}]{{1,{NODE_ID_MAX_LEN}}}$")
_NOT_ID_CHAR_RE = re.compile(f"[^{NODE_ID_CHARS}]")
_TCP_RE = re.compile(r"^tcp://([^\s:/]+|\[[0-9a-fA-F:]+\]):(\d{1,5})$")

NodeId = Annotated[
    str,
    msgspec.Meta(min_length=1, max_length=NODE_ID_MAX_LEN, pattern=f"^[{NODE_ID_CHARS}]+$"),
]
"""A node id on the wire (msgspec checks it while decoding)."""

Address = Annotated[str, msgspec.Meta(min_length=6, max_length=256, pattern=r"^tcp://[^\s]+:\d+$")]
"""A daemon's control address on the wire: ``tcp://HOST:PORT``."""

Endpoint = Annotated[
    str,
    msgspec.Meta(min_length=7, max_length=256, pattern=r"^(tcp://[^\s]+:\d+|ipc://[^\s]+)$"),
]
"""A trainer's data-plane endpoint (allreduce or shard server): ``tcp://HOST:PORT`` or
``ipc://PATH``."""


def is_node_id(value: object) -> bool:
    """Whether ``value`` is a valid node id (:data:`NODE_ID_RULE`)."""
    return isinstance(value, str) and _NODE_ID_RE.match(value) is not None


def check_node_id(value: str, what: str = "node id") -> str:
    """Checks a node id against :data:`NODE_ID_RULE`.

    Args:
        value: The id.
        what: What the id is, for the error message.

    Returns:
        The id.

    Raises:
        ConfigError: the id is invalid.
    """
    if not isinstance(value, str) or not _NODE_ID_RE.match(value):
        raise ConfigError(f"invalid {what} {value!r}: use {NODE_ID_RULE}")
    return value


def node_id_from(text: str, max_len: int = NODE_ID_MAX_LEN, fallback: str = "node") -> str:
    """Turns free text (a host name, say) into a valid node id part.

    Every character a node id cannot hold becomes ``-``, and the result is cut to ``max_len``.

    Args:
        text: The text.
        max_len: The longest result (leave room for what the caller appends).
        fallback: The result when ``text`` is empty.

    Returns:
        Characters that :func:`check_node_id` accepts (``fallback`` for an empty text).
    """
    return _NOT_ID_CHAR_RE.sub("-", text)[:max_len] or fallback


def check_tcp_endpoint(value: str, what: str = "endpoint") -> str:
    """Checks a ``tcp://HOST:PORT`` endpoint with a port in 1..65535.

    Args:
        value: The endpoint.
        what: What the endpoint is, for the error message.

    Returns:
        The endpoint.

    Raises:
        ConfigError: the endpoint is invalid.
    """
    m = _TCP_RE.match(value) if isinstance(value, str) else None
    if m is None or not 1 <= int(m.group(2)) <= 65535:
        raise ConfigError(f"invalid {what} {value!r}: expected tcp://HOST:PORT, port 1-65535")
    return value


def check_daemon_endpoint(value: str) -> str:
    """Checks a daemon's control endpoint: ``ipc://PATH`` or ``tcp://HOST:PORT``.

    Args:
        value: The endpoint.

    Returns:
        The endpoint.

    Raises:
        ConfigError: the endpoint is neither.
    """
    if not (isinstance(value, str) and value.startswith("ipc://")):
        check_tcp_endpoint(value, "daemon endpoint (ipc://PATH or tcp://HOST:PORT)")
    return value


def is_loopback_endpoint(value: str) -> bool:
    """Whether a ``tcp://HOST:PORT`` endpoint's host is a loopback address (``127.0.0.0/8``,
    ``::1`` or ``localhost``); names other than ``localhost`` are not resolved and count as
    not loopback."""
    m = _TCP_RE.match(value) if isinstance(value, str) else None
    return m is not None and is_loopback_host(m.group(1).strip("[]"))


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` is a loopback address (``127.0.0.0/8``, ``::1``) or ``localhost``; other
    names are not resolved and count as not loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
