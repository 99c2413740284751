"""A key holder is not a scheduler: forged scheduler, view and command messages are refused.

Every daemon is a real ``chaos-daemon`` process on loopback with one cluster key (the ``keyed``
fixture); the attacker is a process that holds the key but never joined, with a fresh keypair
of its own. Each forged batch is followed on the same connection by a ``status`` request: its
answer means the daemon has handled every frame before it, so nothing here waits for time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
from chaos.daemon.vote_certs import VoteSigner

from chaos.protocol import (
    ClusterUpdate,
    ClusterView,
    ConnectCommand,
    JoinRequest,
    Message,
    Refusal,
    SchedulerHeartbeat,
    StatusReply,
    StatusRequest,
    SyncPolicyWire,
    TimeoutNow,
    Vote,
    decode,
    encode,
)
from chaos.security import Security
from tests.daemon.daemon_helpers import Cluster, Node, wait_until
from tests.daemon.test_cluster_key import keyed, keyed_status, raw_answers, start_keyed

__all__ = ["keyed"]  # the fixture, used by name

ATTACKER_ADDRESS = "tcp://127.0.0.1:9"


def _status(node: Node, key: Path) -> StatusReply:
    st = keyed_status(node, key)
    assert isinstance(st, StatusReply)
    return st


def _bindings(st: StatusReply) -> dict[str, tuple[str, str]]:
    """Each member's bound key and address, as one daemon sees them."""
    return {n.id: (n.public_key, n.address) for n in st.nodes}


def _send_then_status(node: Node, msgs: list[Message], sec: Security) -> list[Any]:
    """Sends ``msgs`` and a status request on one connection; the answers, once the status
    came back (so every message before it was handled)."""
    frames = [encode(m) for m in msgs] + [encode(StatusRequest(sender=""))]
    answers = [decode(a, 1 << 22) for a in raw_answers(node, frames, sec, 3.0)]
    assert any(isinstance(a, StatusReply) for a in answers), answers
    return answers


def _forged_update(st: StatusReply, sender: str, attacker: Security, cert: list[Vote]) -> Any:
    """A view naming ``sender`` scheduler, binding n2 to the attacker's key and pointing n3 at
    the attacker's address."""
    nodes = []
    for n in st.nodes:
        if n.id == "n2":
            n = msgspec.structs.replace(n, public_key=attacker.public_key)
        elif n.id == "n3":
            n = msgspec.structs.replace(n, address=ATTACKER_ADDRESS)
        nodes.append(n)
    view = ClusterView(epoch=st.epoch + 1, term=st.term + 1, scheduler=sender, nodes=nodes,
                       links=[])  # fmt: skip
    return ClusterUpdate(sender=sender, epoch=st.epoch + 1, term=st.term + 1, view=view,
                         sync=SyncPolicyWire(kind="single", nodes=[]), cert=cert)  # fmt: skip


def _refused_scheduler(node: Node) -> list[dict[str, Any]]:
    return [e for e in node.events() if e.get("event") == "refused_scheduler"]


def test_a_key_holder_cannot_make_itself_or_a_member_scheduler(
    keyed: tuple[Cluster, Path],
) -> None:
    cluster, key = keyed
    nodes = start_keyed(cluster, key, 3)
    before = _status(nodes[0], key)
    attacker = Security.from_key_file(key)  # the key, a keypair of its own, never joined
    forger = VoteSigner()  # signs "votes" with a key no member has
    t = before.term
    fake_cert = [Vote(voter=v, signature=forger.sign(t + 1, "ghost", v)) for v in ("n1", "n2")]
    for node in nodes:
        forged: list[Message] = [
            SchedulerHeartbeat(sender="ghost", epoch=before.epoch, term=t + 1),
            SchedulerHeartbeat(sender="ghost", epoch=before.epoch, term=t + 3, cert=fake_cert),
            _forged_update(before, "ghost", attacker, []),
            _forged_update(before, "ghost", attacker, fake_cert),
            ConnectCommand(sender="ghost", epoch=before.epoch, term=t + 1, peer="n2",
                           address=ATTACKER_ADDRESS),  # fmt: skip
            TimeoutNow(sender="ghost", epoch=before.epoch, term=t),
        ]
        answers = _send_then_status(node, forged, attacker)
        assert not [a for a in answers if isinstance(a, Refusal)], answers  # dropped unanswered
        refused = _refused_scheduler(node)
        assert len(refused) >= len(forged) - 1, refused  # TimeoutNow: ignored as a handover
        assert {e["sender"] for e in refused} == {"ghost"}
    for node in nodes:
        st = _status(node, key)
        assert st.scheduler == before.scheduler and st.term == t, (node.id, st)
        assert _bindings(st) == _bindings(before), node.id
    # the cluster's own election still works with signed votes: kill the scheduler
    old = next(n for n in nodes if n.id == before.scheduler)
    cluster.kill9(old)
    rest = [n for n in nodes if n is not old]

    def elected() -> bool:
        sts = [_status(n, key) for n in rest]
        return all(s.scheduler not in (None, old.id) for s in sts) and len(
            {s.scheduler for s in sts}
        ) == 1

    wait_until(elected, "a new scheduler that both members follow")
    after = _status(rest[0], key)
    assert after.term > t


def test_a_member_id_from_another_key_cannot_send_as_scheduler(
    keyed: tuple[Cluster, Path],
) -> None:
    """A forged heartbeat naming a real member as its sender comes over the attacker's own
    connection: refused, as that id is bound to another key."""
    cluster, key = keyed
    nodes = start_keyed(cluster, key, 3)
    st = _status(nodes[0], key)
    member = next(n.id for n in st.nodes if n.id != st.scheduler)
    attacker = Security.from_key_file(key)
    target = next(n for n in nodes if n.id not in (member, st.scheduler))
    hb = SchedulerHeartbeat(sender=member, epoch=st.epoch, term=st.term + 1)
    answers = _send_then_status(target, [hb], attacker)
    refusals = [a for a in answers if isinstance(a, Refusal)]
    assert refusals and refusals[0].reason.value == "not_authenticated", answers
    after = _status(target, key)
    assert after.scheduler == st.scheduler and after.term == st.term


def test_a_stale_term_refusal_from_a_stranger_does_not_depose_the_scheduler(
    keyed: tuple[Cluster, Path],
) -> None:
    cluster, key = keyed
    nodes = start_keyed(cluster, key, 3)
    st = _status(nodes[0], key)
    scheduler = next(n for n in nodes if n.id == st.scheduler)
    attacker = Security.from_key_file(key)
    forged = Refusal(sender="ghost", epoch=st.epoch, reason="stale_term", term=st.term + 100)
    _send_then_status(scheduler, [forged], attacker)
    after = _status(scheduler, key)
    assert after.role == "scheduler" and after.term == st.term, after


def test_a_join_under_a_live_members_id_with_another_key_is_refused(
    keyed: tuple[Cluster, Path],
) -> None:
    """A key holder that names a live member's id (at that member's own address) is refused
    ``id_in_use``: the member keeps its key and its address."""
    cluster, key = keyed
    nodes = start_keyed(cluster, key, 3)
    st = _status(nodes[0], key)
    scheduler = next(n for n in nodes if n.id == st.scheduler)
    victim = next(n for n in st.nodes if n.id != st.scheduler)
    attacker = Security.from_key_file(key)
    join = JoinRequest(sender=victim.id, node_id=victim.id, address=victim.address,
                       public_key=attacker.public_key)  # fmt: skip
    _send_then_status(scheduler, [join], attacker)

    def refused() -> list[dict[str, Any]]:
        return [e for e in scheduler.events()
                if e.get("event") == "join_refused" and e.get("reason") == "id_in_use"]  # fmt: skip

    wait_until(refused, "the join refused id_in_use")
    for node in nodes:
        assert _bindings(_status(node, key)) == _bindings(st), node.id


def test_a_restarted_member_comes_back_under_its_id_with_a_new_key(
    keyed: tuple[Cluster, Path],
) -> None:
    """The id_in_use rule does not lock out a device that restarts: its new incarnation (a
    new keypair) is admitted once the old one falls silent."""
    cluster, key = keyed
    nodes = start_keyed(cluster, key, 3)
    st = _status(nodes[0], key)
    victim = next(n for n in nodes if n.id != st.scheduler and n.id != "n1")
    old_key = _bindings(st)[victim.id][0]
    cluster.kill9(victim)
    via = next(n for n in nodes if n is not victim)
    again = cluster.spawn(victim.id, join=via, neighbors=(via.id,), wait=False,
                          port=victim.port)  # fmt: skip

    def back() -> bool:
        if not again.alive():
            raise AssertionError(f"{victim.id} exited: {again.proc.returncode}")
        b = _bindings(_status(via, key))
        return victim.id in b and b[victim.id][0] not in ("", old_key) and (
            _status(again, key).state == "active"
        )

    wait_until(back, f"{victim.id} back under a new key")
