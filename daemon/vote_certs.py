"""Signed votes and the certificate that proves a scheduler won its election (no I/O).

With a cluster key, every key holder can reach every port, so a scheduler's word (its
heartbeat, its view updates, its commands) is taken only from the member that won an election
the receiver can check:

* each daemon has an Ed25519 signing key of its own, made when it starts; its public half
  (:attr:`VoteSigner.public`) is bound to its id at admission, next to its CURVE key, in the
  committed view (``NodeInfo.sign_key``);
* a granted vote is signed: ``VoteReply.signature`` over ``(term, candidate, voter)``
  (:func:`vote_payload`);
* a candidate counts only votes whose signature holds, and a winner's heartbeats and updates
  carry the votes it won with (``cert``): a strict majority of the receiver's membership, each
  signed by the voter's bound key, for that term and that candidate (:func:`certificate_problem`).

A receiver that voted for the sender in that term needs no certificate (its own vote), and one
that already follows the sender in that term has checked it before.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from chaos.protocol import ClusterUpdate, ClusterView, Message, SchedulerHeartbeat, Vote, VoteReply

__all__ = ["VoteBook", "VoteSigner", "certificate_problem", "signature_holds", "vote_payload"]

_LABEL = b"chaos-vote/1"


def vote_payload(term: int, candidate: str, voter: str) -> bytes:
    """The bytes a vote's signature covers: the vote, for one term and one candidate."""
    return b"\x00".join((_LABEL, str(term).encode(), candidate.encode(), voter.encode()))


class VoteSigner:
    """This daemon's signing key (a fresh one per process, like its CURVE keypair)."""

    def __init__(self) -> None:
        self._key = Ed25519PrivateKey.generate()
        raw = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self.public = raw.hex()
        """The public half, hex (64 characters): ``NodeInfo.sign_key``."""

    def sign(self, term: int, candidate: str, voter: str) -> str:
        """The signature (hex, 128 characters) of ``voter``'s vote for ``candidate``."""
        return self._key.sign(vote_payload(term, candidate, voter)).hex()


def signature_holds(sign_key: str, signature: str, term: int, candidate: str, voter: str) -> bool:
    """Whether ``signature`` is ``voter``'s vote for ``candidate`` in ``term`` under
    ``sign_key`` (both hex; anything malformed does not hold)."""
    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(sign_key))
        key.verify(bytes.fromhex(signature), vote_payload(term, candidate, voter))
    except (ValueError, InvalidSignature):
        return False
    return True


def _sign_keys(view: ClusterView | None) -> dict[str, str]:
    return {n.id: n.sign_key for n in view.nodes} if view is not None else {}


def certificate_problem(
    cert: Sequence[Vote], term: int, candidate: str, view: ClusterView | None,
    own_vote: Iterable[str] = (),
) -> str | None:  # fmt: skip
    """Why ``cert`` does not prove that ``candidate`` won ``term`` for this receiver.

    The cheap checks come first (members, duplicates, the count), so a forged certificate costs
    at most one signature check per member before it is refused.

    Args:
        cert: The votes the message carries.
        term: The term it claims.
        candidate: Its sender, the claimed winner.
        view: The receiver's committed view (the members and their bound signing keys).
        own_vote: Members whose vote for ``candidate`` in ``term`` the receiver knows without a
            signature (itself, when it granted that vote).

    Returns:
        ``None`` when it proves it; otherwise why not.
    """
    keys = _sign_keys(view)
    if candidate not in keys:
        return f"{candidate!r} is not a member"
    voters = [v.voter for v in cert]
    if len(set(voters)) != len(voters):
        return "a voter is named twice"
    # a vote from a member this receiver does not know yet (its view is behind) is not counted
    counted = (set(own_vote) | set(voters)) & set(keys)
    if 2 * len(counted) <= len(keys):
        return f"{len(counted)} of {len(keys)} members' votes is no majority"
    known = set(own_vote)
    for v in cert:
        if v.voter in known or v.voter not in keys:
            continue
        if not keys[v.voter]:
            return f"{v.voter!r} has no bound signing key"
        if not signature_holds(keys[v.voter], v.signature, term, candidate, v.voter):
            return f"the vote of {v.voter!r} does not verify"
    return None


class VoteBook:
    """One daemon's signed votes: those it gives, those it wins with, and the schedulers it
    has verified.

    Args:
        node_id: This daemon.
        signer: Its signing key (``None``: no cluster key; nothing is signed or checked).
    """

    def __init__(self, node_id: str, signer: VoteSigner | None) -> None:
        self.node_id = node_id
        self.signer = signer
        self._term = -1
        self._won: dict[str, str] = {}  # voter -> signature, for ``_term``
        self._verified: tuple[int, str] | None = None  # the last (term, scheduler) checked

    @property
    def sign_key(self) -> str:
        """This daemon's public signing key (empty: none)."""
        return self.signer.public if self.signer is not None else ""

    def grant(self, reply: VoteReply, candidate: str) -> VoteReply:
        """``reply``, signed when it grants the vote."""
        if self.signer is None or not reply.granted:
            return reply
        sig = self.signer.sign(reply.term, candidate, self.node_id)
        return msgspec.structs.replace(reply, signature=sig)

    def stand(self, term: int) -> None:
        """A new candidacy (or a bootstrap) in ``term``: its own vote is the first."""
        self._term = term
        self._won = {}
        if self.signer is not None:
            self._won[self.node_id] = self.signer.sign(term, self.node_id, self.node_id)

    def take(self, msg: VoteReply, view: ClusterView | None) -> VoteReply:
        """A vote for this node: kept when its signature holds under the voter's bound key,
        else counted as not granted (a candidate must be able to show every vote it counts).
        Votes that come after the win are kept too: a fuller certificate convinces members
        whose view is behind."""
        if self.signer is None or not msg.granted or msg.term != self._term:
            return msg
        key = _sign_keys(view).get(msg.sender, "")
        if key and signature_holds(key, msg.signature, msg.term, self.node_id, msg.sender):
            self._won[msg.sender] = msg.signature
            return msg
        return msgspec.structs.replace(msg, granted=False)

    def cert(self, term: int) -> list[Vote]:
        """The signed votes this node won ``term`` with (empty: none, or no cluster key)."""
        if self.signer is None or term != self._term:
            return []
        return [Vote(voter=v, signature=s) for v, s in sorted(self._won.items())]

    def scheduler_problem(
        self, msg: Message, term: int, following: str | None, voted_for: str | None,
        view: ClusterView | None,
    ) -> str | None:  # fmt: skip
        """Why a scheduler's message (heartbeat, update, command) is not taken from its
        sender: it must be the scheduler this node follows in that term, one it voted for in
        that term, or one whose heartbeat or update carries a certificate that holds.

        Args:
            msg: A validated ``"scheduler"`` or ``"command"`` message (it has ``term``).
            term: This node's term.
            following: The scheduler it follows (``None``: none).
            voted_for: Whom it voted for in ``term``.
            view: Its committed view.

        Returns:
            ``None`` when it is taken; otherwise why not.
        """
        if self.signer is None:
            return None
        sender, claimed = msg.sender, getattr(msg, "term", -1)
        if claimed == term and sender in (following, voted_for):
            return None
        if self._verified == (claimed, sender):
            return None
        if not isinstance(msg, (SchedulerHeartbeat, ClusterUpdate)):
            return f"a command from {sender!r}, not the scheduler this node follows in term " \
                   f"{claimed}"
        why = certificate_problem(msg.cert, claimed, sender, view)
        if why is None:
            self._verified = (claimed, sender)
            return None
        return f"{sender!r} shows no election won in term {claimed}: {why}"
