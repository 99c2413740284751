"""A ZeroMQ connection that was sending when its link was cut recovers once the link is back.

Two devices, one link. A client (``DEALER``, set up by :func:`chaos.sockets.keep_alive` as every
long-lived socket of Chaos is) talks to an echo server (``ROUTER``) in the other namespace. The
link is cut while a message is in flight: the kernel retransmits it with a growing back-off, so
without a user timeout the connection stays open and silent for many minutes, even after the
link is restored. With it the connection is dropped, ZeroMQ connects again, and a message sent
after the restore is echoed. Real processes in real namespaces; no timing is asserted (the
deadlines only bound a hang). Needs root; the namespaces are reaped by the fixture of
``test_emulate_network.py``, and the processes by the network and the ``finally`` here.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from typing import Any

from chaos.emulate import Network
from tests.emulate.test_emulate_network import (
    MBIT,
    _cfg,
    _reap_namespaces,  # noqa: F401 - the autouse fixture that removes every namespace left
    needs_root,
)

SERVER = r"""
import sys, zmq
from chaos.sockets import keep_alive
ctx = zmq.Context()
s = ctx.socket(zmq.ROUTER)
s.setsockopt(zmq.LINGER, 0)
keep_alive(s)
s.bind(sys.argv[1])
print("ready", flush=True)
while True:
    s.send_multipart(s.recv_multipart())
"""

CLIENT = r"""
import json, sys, zmq
from zmq.utils.monitor import recv_monitor_message
from chaos.sockets import keep_alive
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 0)
keep_alive(s)
mon = s.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
s.connect(sys.argv[1])
poller = zmq.Poller()
for x in (s, mon, sys.stdin.fileno()):
    poller.register(x, zmq.POLLIN)
def say(**kw):
    print(json.dumps(kw), flush=True)
while True:
    for x, _ in poller.poll():
        if x is s:
            say(echo=len(s.recv()))
        elif x is mon:
            ev = recv_monitor_message(mon)["event"]
            say(event="connected" if ev == zmq.EVENT_CONNECTED else "disconnected")
        else:
            line = sys.stdin.readline()
            if not line:
                raise SystemExit(0)
            s.send(b"x" * int(line))
"""


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    q: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            q.put(line.strip())

    threading.Thread(target=pump, daemon=True).start()
    return q


def _expect(q: queue.Queue[str], want: dict[str, Any], timeout_s: float, seen: list[str]) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"no {want} within {timeout_s} s; the client said {seen}")
        try:
            line = q.get(timeout=left)
        except queue.Empty:
            continue
        seen.append(line)
        if line.startswith("{") and json.loads(line) == want:
            return


@needs_root
def test_a_connection_cut_mid_send_is_made_again_once_the_link_is_back() -> None:
    with Network(_cfg("ab", [("a", "b", 100 * MBIT)])) as net:
        endpoint = f"tcp://{net.address('b')}:7711"
        server = net.popen("b", [sys.executable, "-c", SERVER, endpoint],
                           stdout=subprocess.PIPE, text=True)  # fmt: skip
        client = net.popen("a", [sys.executable, "-c", CLIENT, endpoint], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert client.stdin is not None
            seen: list[str] = []
            srv, out = _lines(server), _lines(client)
            assert srv.get(timeout=30) == "ready"
            _expect(out, {"event": "connected"}, 30, seen)

            def send(n: int) -> None:
                assert client.stdin is not None
                client.stdin.write(f"{n}\n")
                client.stdin.flush()

            send(1000)
            _expect(out, {"echo": 1000}, 30, seen)
            net.cut_link("a", "b")
            send(200_000)  # in flight when the link went: retransmitted into the cut
            _expect(out, {"event": "disconnected"}, 90, seen)  # the user timeout dropped it
            net.restore_link("a", "b")
            deadline = time.monotonic() + 60
            while True:  # a DEALER drops what it queued for a connection that went away
                send(3000)
                try:
                    _expect(out, {"echo": 3000}, 2, seen)
                    break
                except AssertionError:
                    if time.monotonic() > deadline:
                        raise
        finally:
            for p in (client, server):
                p.kill()
                p.wait(timeout=10)
