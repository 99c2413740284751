"""Where the daemon's messages go: to peers, back to whoever asked, or to itself.

A node is also a member of the cluster it schedules, so it sends messages to itself; those go
through a local queue that the event loop drains, never through recursion.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from chaos.daemon.transport import ReplyPath, Transport

from chaos.protocol import Message, encode


class Outbox:
    """The daemon's ways out.

    Args:
        node_id: This node (a message to it goes to the local queue).
        transport: The sockets.
        scheduler: The scheduler's id, if one is known (this node's own while it schedules).
    """

    def __init__(
        self, node_id: str, transport: Transport, scheduler: Callable[[], str | None]
    ) -> None:
        self.node_id = node_id
        self.transport = transport
        self.scheduler = scheduler
        self.local: deque[Message] = deque()
        """Messages to this node itself, drained by the event loop."""

    def send(self, peer: str, msg: Message, attachment: bytes | None = None) -> bool:
        """Sends to a peer (to itself through the local queue), with ``attachment`` if given."""
        if peer == self.node_id:
            self.local.append(msg)
            return True
        return self.transport.send_peer(peer, encode(msg), attachment)

    def broadcast(self, peers: dict[str, str], msg: Message) -> None:
        """Sends one message to several peers (id -> address), encoding it once."""
        frame = encode(msg)
        for peer, address in peers.items():
            if peer == self.node_id:
                self.local.append(msg)
            else:
                self.transport.ensure_peer(peer, address)
                self.transport.send_peer(peer, frame)

    def to_scheduler(self, msg: Message) -> bool:
        """Sends to the scheduler; ``False`` when none is known."""
        scheduler = self.scheduler()
        return scheduler is not None and self.send(scheduler, msg)

    def respond(self, reply: ReplyPath | None, msg: Message) -> None:
        """Answers on an inbound frame's path (``None``: a local message)."""
        if reply is None:
            self.local.append(msg)
        else:
            self.transport.reply(reply, encode(msg))

    def send_to_address(self, peer: str, address: str, msg: Message) -> None:
        """Opens a DEALER to ``peer`` if needed and sends."""
        self.transport.ensure_peer(peer, address)
        self.send(peer, msg)

    def connect_peer(self, peer: str, address: str) -> bool:
        """Opens the DEALER to ``peer``; ``True`` when it was already open."""
        return peer != self.node_id and self.transport.ensure_peer(peer, address)

    def peer_address(self, peer: str) -> str | None:
        """The address this node's DEALER to ``peer`` points at (``None``: none open)."""
        cur = self.transport.dealers.get(peer)
        return cur[0] if cur is not None else None
