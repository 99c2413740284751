"""The scheduler role's daemon without the sockets, for testing the role's rules in process.

:class:`RoleHost` is the host a :class:`chaos.daemon.scheduler.role.SchedulerRole` is built
on (``SchedulerHost``): it records what the role sends, answers, broadcasts and logs, so a
test can check it; the transport is not under test here.
"""

from __future__ import annotations

from typing import Any


class RoleHost:
    """The scheduler role's daemon, minus the sockets: node ``a`` in term 1.

    Attributes:
        answers: The replies given to local clients, in order.
        events: The events logged, as ``(name, fields)``.
        updates: The messages broadcast to the members (the committed epochs).
        sent: The messages sent to one peer, as ``(peer, message)``.
    """

    node_id = "a"
    address = "tcp://127.0.0.1:1"
    public_key = ""
    sign_key = ""
    vote_cert: list[Any] = []
    term = 1

    def __init__(self) -> None:
        self.answers: list[Any] = []
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.updates: list[Any] = []
        self.sent: list[tuple[str, Any]] = []
        self.sent_to_address: list[Any] = []

    def send(self, peer: str, msg: Any) -> bool:
        self.sent.append((peer, msg))
        return True

    def respond(self, reply: Any, msg: Any) -> None:
        self.answers.append(msg)

    def send_to_address(self, peer: str, address: str, msg: Any) -> None:
        self.sent_to_address.append(msg)

    def connect_peer(self, peer: str, address: str) -> bool:
        return False

    def broadcast(self, peers: dict[str, str], msg: Any) -> None:
        self.updates.append(msg)

    def event(self, name: str, **fields: object) -> None:
        self.events.append((name, fields))

    def observe_primitive(self, name: str, seconds: float) -> None:
        pass

    def lost_quorum(self) -> None:
        pass

    def named(self, name: str) -> list[dict[str, Any]]:
        """The fields of every event called ``name``, in order."""
        return [f for n, f in self.events if n == name]
