"""Terms and epochs at the wire limit: a forged message that carries one is refused as far ahead,
and the cluster goes on (``status`` answers, a later election succeeds).

The daemons run unkeyed on loopback, where any local process may send as any member: the
forged frames below name a real member as their sender. Every daemon is a real ``chaos-daemon``
process, killed and reaped when the test ends (the ``cluster`` fixture).
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import zmq
from chaos.daemon.config import DaemonConfig
from chaos.daemon.election import Election
from daemon_helpers import Cluster, Node, wait_until

from chaos.errors import CounterLimit
from chaos.protocol import MAX_COUNTER, PROTOCOL_VERSION, Refusal, decode

_REPLY_S = 10.0


def _answer(sock: zmq.Socket[bytes], **fields: Any) -> Any:
    sock.send(msgspec.msgpack.encode({"v": PROTOCOL_VERSION, **fields}))
    if not sock.poll(int(_REPLY_S * 1000), zmq.POLLIN):
        pytest.fail("no answer from the daemon")
    return decode(sock.recv_multipart()[-1], 64 << 20)


def _far_ahead(answer: Any, what: str) -> None:
    assert isinstance(answer, Refusal), answer
    assert answer.reason == "bad_request" and "too far ahead" in answer.detail, answer
    assert what in answer.detail, answer


def _elects_again(cluster: Cluster, nodes: list[Node]) -> None:
    """Kills the scheduler; the others must elect a new one with a small term."""
    first = nodes[0].status()
    old = next(n for n in nodes if n.id == first.scheduler)
    cluster.kill9(old)
    rest = [n for n in nodes if n is not old]

    def elected() -> bool:
        sts = [n.status() for n in rest]
        return all(s.scheduler not in (None, old.id) for s in sts) and len(
            {s.scheduler for s in sts}
        ) == 1

    wait_until(elected, "a new scheduler")
    for n in rest:
        st = n.status()
        assert first.term < st.term < first.term + 1000, (first.term, st.term)
        assert st.epoch < first.epoch + 1000, (first.epoch, st.epoch)


def test_a_heartbeat_with_the_largest_term_is_refused(cluster: Cluster, dealer: Any) -> None:
    nodes = cluster.start(3)
    st = nodes[1].status()
    for n in nodes:
        answer = _answer(
            dealer(n.address),
            type="scheduler_heartbeat",
            sender=st.scheduler,
            epoch=st.epoch,
            term=MAX_COUNTER,
        )
        _far_ahead(answer, "term")
    for n in nodes:
        assert n.status().term < 1000
    _elects_again(cluster, nodes)


def test_a_vote_request_with_the_largest_term_is_refused(cluster: Cluster, dealer: Any) -> None:
    nodes = cluster.start(3)
    st = nodes[0].status()
    follower = next(n for n in nodes if n.id != st.scheduler)
    other = next(n for n in nodes if n.id not in (st.scheduler, follower.id))
    answer = _answer(
        dealer(follower.address),
        type="request_vote",
        sender=other.id,
        epoch=st.epoch,
        term=MAX_COUNTER,
    )
    _far_ahead(answer, "term")
    assert follower.status().term < 1000
    _elects_again(cluster, nodes)


def test_a_report_with_the_largest_epoch_is_refused(cluster: Cluster, dealer: Any) -> None:
    nodes = cluster.start(3)
    st = nodes[0].status()
    scheduler = next(n for n in nodes if n.id == st.scheduler)
    member = next(n for n in nodes if n.id != st.scheduler)
    answer = _answer(
        dealer(scheduler.address),
        type="agent_report",
        sender=member.id,
        epoch=MAX_COUNTER,
        term=st.term,
        address=member.address,
        joined_at=0.0,
    )
    _far_ahead(answer, "epoch")
    assert scheduler.status().epoch < 1000
    _elects_again(cluster, nodes)


def test_an_election_at_the_limit_makes_no_term_beyond_it() -> None:
    e = Election("a", DaemonConfig(node_id="a", listen="tcp://127.0.0.1:5000"))
    e.term = MAX_COUNTER - 1
    assert e.start(0.0, 1).term == MAX_COUNTER
    with pytest.raises(CounterLimit):
        e.start(1.0, 1)
    assert e.term == MAX_COUNTER
