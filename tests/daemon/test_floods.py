"""Floods a stranger or a local process can cause leave bounded traces: refused handshakes and
refused commands are logged and recorded one by one only at first, then once every so many,
and counted in the metrics.

Every daemon is a real ``chaos-daemon`` process on loopback, killed and reaped when the test ends
(the ``cluster`` fixture). Each flood is a bounded loop that stops by itself.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

import msgspec
import zmq
from chaos.daemon.client import DaemonClient
from chaos.daemon.dispatch import REFUSAL_RECORDS_EVERY, REFUSAL_RECORDS_FIRST
from chaos.daemon.metrics import metrics_token
from daemon_helpers import Cluster, wait_until

from chaos.launch import free_port
from chaos.protocol import PROTOCOL_VERSION, Refusal, decode
from chaos.security import ClusterKey, Security

_STRANGERS = 150
_FORGED = 2500
_REPLY_S = 10.0


def _refused_handshakes(port: int, token: str) -> float:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(req, timeout=5.0) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith("chaos_refusals_total{") and 'reason="handshake_failed"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_stranger_reconnecting_in_a_loop_is_logged_a_few_times(
    cluster: Cluster, tmp_path: Path
) -> None:
    key = ClusterKey.generate().write(tmp_path / "cluster.key")
    mport = free_port()
    n1 = cluster.spawn(
        "n1", extra=("--cluster-key", str(key), "--metrics-port", str(mport)), wait=False
    )
    sec = Security.from_key_file(key)

    def active() -> bool:
        with DaemonClient(n1.address, timeout_s=2.0, security=sec) as c:
            return c.status().state == "active"

    wait_until(active, "n1 active")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    # the stranger sees its refusal as a failed handshake or, when the daemon closes first, as a
    # plain disconnect: either ends one attempt
    ended = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
             | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_DISCONNECTED)  # fmt: skip
    refused = 0
    try:
        for _ in range(_STRANGERS):  # a stranger without the key, one connection after another
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            mon = s.get_monitor_socket(ended)
            s.connect(n1.address)
            s.send(b"hello")
            refused += bool(mon.poll(int(_REPLY_S * 1000), zmq.POLLIN))
            s.disable_monitor()
            mon.close(linger=0)
            s.close(linger=0)
    finally:
        ctx.destroy(linger=0)  # closes every socket left open, so a failure cannot hang here
    assert refused >= _STRANGERS // 2, f"only {refused} of {_STRANGERS} attempts were refused"
    token = metrics_token(ClusterKey.load(key))
    wait_until(lambda: _refused_handshakes(mport, token) >= refused, "every refusal counted")
    log = (n1.run_dir / "stderr.log").read_text()
    lines = [x for x in log.splitlines() if "CURVE handshake failed" in x]
    assert 1 <= len(lines) <= 5 + _STRANGERS // 1000 + 1, lines
    with DaemonClient(n1.address, timeout_s=2.0, security=sec) as c:
        assert c.status().node_id == "n1"


def test_a_flood_of_refused_commands_grows_the_event_file_a_little(cluster: Cluster) -> None:
    n1 = cluster.spawn("n1", fault_injection=False)
    fields = {"v": PROTOCOL_VERSION, "type": "fault_command", "name": "clear"}
    frame = msgspec.msgpack.encode(fields)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(n1.ipc)
    try:
        got = 0
        for _ in range(_FORGED):
            sock.send(frame)
            assert sock.poll(int(_REPLY_S * 1000), zmq.POLLIN), "no answer"
            answer = decode(sock.recv_multipart()[-1], 1 << 20)
            assert isinstance(answer, Refusal) and answer.reason == "forbidden", answer
            got += 1
    finally:
        sock.close(linger=0)
        ctx.destroy(linger=0)  # closes every socket left open, so a failure cannot hang here
    assert got == _FORGED
    records = [e for e in n1.events() if e["event"] == "refused_command"]
    assert len(records) == REFUSAL_RECORDS_FIRST + _FORGED // REFUSAL_RECORDS_EVERY, records
    assert records[-1]["count"] == (_FORGED // REFUSAL_RECORDS_EVERY) * REFUSAL_RECORDS_EVERY
    assert n1.status().node_id == "n1"
