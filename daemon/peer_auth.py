"""Who may speak for a node id: the sender check of an authenticated connection.

With a cluster key every TCP connection to the daemon is a CURVE connection, and each frame
carries its client's public key (:attr:`chaos.daemon.transport.Inbound.peer_key`). A node's id
is bound to its daemon's public key when the scheduler admits it (``NodeInfo.public_key`` in
the committed view). A message is refused when its ``sender`` is bound to another key than the
connection's: a key holder cannot speak for another member. A join names its own key
(``JoinRequest.public_key``), which must be the connection's; a forwarded join is checked
against the member that forwards it.

Frames without a peer key (the local IPC socket, answers on this node's own DEALERs, or a
daemon without a cluster key) are not checked here.
"""

from __future__ import annotations

from chaos.protocol import ClusterView, JoinRequest, Message

__all__ = ["bound_key", "sender_refusal"]


def bound_key(view: ClusterView | None, node: str) -> str:
    """The public key bound to ``node`` in ``view`` (empty: none known)."""
    if view is None:
        return ""
    for n in view.nodes:
        if n.id == node:
            return n.public_key
    return ""


def sender_refusal(msg: Message, peer_key: str | None, view: ClusterView | None) -> str | None:
    """Why ``msg`` may not come from the connection authenticated as ``peer_key``.

    Args:
        msg: A validated message.
        peer_key: The connection's CURVE public key (``None``: not authenticated, not checked).
        view: The committed cluster view (the ids' bound keys).

    Returns:
        ``None`` when it may; otherwise the refusal's detail.
    """
    if peer_key is None:
        return None
    if isinstance(msg, JoinRequest) and msg.forwarded_by is None:
        if msg.public_key != peer_key:
            return "a join's public_key must be the key of the connection it comes in on"
        return None  # a restarted incarnation rebinds its id at admission (scale-out rules)
    sender = getattr(msg, "sender", "")
    bound = bound_key(view, sender)
    if bound and bound != peer_key:
        return f"sender {sender!r} is bound to another key than this connection's"
    return None
