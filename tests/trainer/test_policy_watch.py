"""PolicyWatch: when the trainer must ask its daemon for the policy (real zmq sockets).

The daemon side (the notices a real ``chaos-daemon`` publishes) is covered at the end.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from chaos.protocol import Ping, PolicyNotice, PolicyReply, encode
from chaos.trainer.policy_watch import SILENCE_FACTOR, PolicyWatch

INTERVAL_S = 0.5


@pytest.fixture
def pub(tmp_path: Path) -> Iterator[tuple[zmq.Socket[bytes], str]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    addr = f"ipc://{tmp_path}/n.notify"
    sock.bind(addr)
    try:
        yield sock, addr
    finally:
        sock.close(linger=0)
        ctx.term()


def _notice(epoch: int, paused: bool = False) -> bytes:
    return encode(PolicyNotice(sender="n1", epoch=epoch, paused=paused, interval_s=INTERVAL_S))


def _deliver(sock: zmq.Socket[bytes], watch: PolicyWatch, frame: bytes, epoch: int) -> float:
    """Publishes ``frame`` once the subscription is up and waits until the watch took it;
    returns the watch's clock then.

    A SUB socket misses what is published before its connection is up, so probe notices
    (epoch 0) go out until one arrives; ``frame`` itself is sent once, and being FIFO, it is
    the last notice the watch takes.
    """
    deadline = time.monotonic() + 10.0
    while watch.latest_epoch < 0:
        if time.monotonic() > deadline:
            raise AssertionError("the subscription never connected")
        sock.send(_notice(0))
        watch.needs_fetch(epoch, time.monotonic())
        time.sleep(0.01)  # waiting for the subscription to connect
    sock.send(frame)
    while time.monotonic() < deadline:
        now = time.monotonic()
        watch.needs_fetch(epoch, now)
        if watch.latest_epoch == epoch:
            return now
        time.sleep(0.001)
    raise AssertionError("the notice never arrived")


def test_asks_until_it_hears_then_only_for_a_newer_epoch(pub: tuple) -> None:
    sock, addr = pub
    watch = PolicyWatch(addr)
    try:
        assert watch.needs_fetch(3, time.monotonic())  # nothing heard yet: ask
        now = _deliver(sock, watch, _notice(3), 3)
        assert not watch.needs_fetch(3, now)  # installed epoch 3 is the newest
        assert watch.needs_fetch(2, now)  # the trainer is behind
        now = _deliver(sock, watch, _notice(4), 4)
        assert watch.needs_fetch(3, now)
        assert not watch.needs_fetch(4, now)
    finally:
        watch.close()


def test_a_silent_notifier_or_a_paused_daemon_means_ask(pub: tuple) -> None:
    sock, addr = pub
    watch = PolicyWatch(addr)
    try:
        now = _deliver(sock, watch, _notice(5), 5)
        assert not watch.needs_fetch(5, now + SILENCE_FACTOR * INTERVAL_S * 0.9)
        assert watch.needs_fetch(5, now + SILENCE_FACTOR * INTERVAL_S * 1.1)  # silent: ask
        now = _deliver(sock, watch, _notice(6, paused=True), 6)
        assert watch.needs_fetch(6, now)  # paused: the trainer asks, as it did before
    finally:
        watch.close()


def test_the_answer_that_gave_the_address_counts_as_a_notice(pub: tuple) -> None:
    """A new watch does not make its trainer ask at every step until the daemon's next
    periodic notice: the policy answer it was made from says the epoch."""
    _sock, addr = pub
    watch = PolicyWatch(addr)
    try:
        now = time.monotonic()
        assert watch.needs_fetch(7, now)  # nothing heard
        silent = PolicyReply(sender="n1", epoch=7, term=1, members=["n1"], sync=None)
        watch.heard(silent, now)  # a daemon that does not say its interval: still ask
        assert watch.needs_fetch(7, now)
        reply = PolicyReply(sender="n1", epoch=7, term=1, members=["n1"], sync=None,
                            notify_address=addr, notify_interval_s=INTERVAL_S)  # fmt: skip
        watch.heard(reply, now)
        assert not watch.needs_fetch(7, now)  # no notice yet, but nothing newer to ask for
        assert watch.needs_fetch(6, now)  # the trainer is behind the answer
        # no notice ever: silent after SILENCE_FACTOR intervals, then it asks at every boundary
        assert watch.needs_fetch(7, now + SILENCE_FACTOR * INTERVAL_S * 1.1)
        paused = PolicyReply(sender="n1", epoch=8, term=1, members=["n1"], sync=None,
                             paused=True, notify_interval_s=INTERVAL_S)  # fmt: skip
        watch.heard(paused, now)
        assert watch.needs_fetch(8, now)  # paused: ask
    finally:
        watch.close()


def test_garbage_and_other_messages_are_ignored_and_counted(pub: tuple) -> None:
    sock, addr = pub
    watch = PolicyWatch(addr)
    try:
        now = _deliver(sock, watch, _notice(7), 7)
        for frame in (b"\x00garbage", encode(Ping(sender="x", seq=1, t=0.0)), b"x" * 10_000):
            sock.send(frame)
        deadline = time.monotonic() + 10.0
        while watch.ignored < 3 and time.monotonic() < deadline:
            watch.needs_fetch(7, now)
            time.sleep(0.01)  # waiting for the three frames to arrive
        assert watch.ignored == 3
        assert watch.latest_epoch == 7 and not watch.needs_fetch(7, now)
    finally:
        watch.close()


def test_a_notice_of_a_change_can_carry_the_policy(pub: tuple) -> None:
    sock, addr = pub
    watch = PolicyWatch(addr)
    reply = PolicyReply(sender="n1", epoch=8, term=1, members=["n1", "n2"], sync=None)
    carrying = encode(PolicyNotice(sender="n1", epoch=8, interval_s=INTERVAL_S, policy=reply))
    try:
        now = _deliver(sock, watch, carrying, 8)
        assert watch.needs_fetch(7, now) and watch.carried(7) == reply  # install it, no asking
        assert watch.carried(8) is None  # not newer than what runs
        _deliver(sock, watch, _notice(8), 8)  # a periodic notice of the same epoch keeps it
        assert watch.carried(7) == reply
        now = _deliver(sock, watch, _notice(9), 9)  # a newer epoch without a policy: ask
        assert watch.needs_fetch(8, now) and watch.carried(8) is None
    finally:
        watch.close()


def test_a_notice_that_evicts_this_trainer_is_seen_while_it_waits_in_a_round(pub: tuple) -> None:
    """A trainer blocked in a round the others gave up on (it was cut off, and evicted) learns
    from its daemon's notice that the newer policy leaves it out, without asking: the round can
    no longer complete, so it stops waiting and joins again. A policy that keeps it, or its own
    leave (its daemon out of the view too), is no such notice."""
    from chaos.protocol import SyncPolicyWire
    from chaos.trainer.session import DaemonSession
    from tests.trainer.test_session import ADDRS, FakeDaemon

    sock, addr = pub

    def policy(epoch: int, view: list[str], sync: list[str]) -> PolicyReply:
        wire = SyncPolicyWire(kind="ring", nodes=sync, ring=sync, addresses=ADDRS)
        return PolicyReply(sender="n1", epoch=epoch, term=1, members=view, sync=wire,
                           notify_address=addr, notify_interval_s=INTERVAL_S)  # fmt: skip

    daemon = FakeDaemon([policy(5, ["a", "b", "c"], ["a", "b", "c"])])
    session = DaemonSession(daemon, "a", poll_interval_s=0.01, policy_timeout_s=10.0,
                            policy_notices=True, contact_since=time.monotonic())  # fmt: skip
    try:
        session.fetch()
        watch = session._watch
        assert watch is not None
        assert session.evicted_epoch(5) == -1
        for epoch, view, sync, expect in (
            (6, ["a", "b", "c"], ["a", "b", "c"], -1),  # a newer policy that keeps this trainer
            (7, ["b", "c"], ["b", "c"], -1),  # its own leave: its daemon is out of the view
            (8, ["a", "b", "c"], ["b", "c"], 8),  # evicted: the others go on without it
        ):
            frame = encode(PolicyNotice(sender="n1", epoch=epoch, interval_s=INTERVAL_S,
                                        policy=policy(epoch, view, sync)))  # fmt: skip
            deadline = time.monotonic() + 10.0
            while watch.latest_epoch != epoch:  # resent until the subscription is up and took it
                if time.monotonic() > deadline:
                    raise AssertionError(f"the notice of epoch {epoch} never arrived")
                sock.send(frame)
                time.sleep(0.01)
                watch.needs_fetch(5, time.monotonic())
            assert session.evicted_epoch(5) == expect, epoch
        assert session.evicted_epoch(8) == -1  # not newer than the installed policy
    finally:
        session.close()
