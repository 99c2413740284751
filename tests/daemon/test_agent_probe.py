"""The node agent's bandwidth probe, without sockets: what it sends and what it reports.

The daemon around the agent is a recording stand-in (the transport is not under test here);
the probe's wire format is checked in ``test_protocol_config.py`` and ``test_fuzz.py``.
"""

from __future__ import annotations

from typing import Any

from chaos.daemon.agent import Agent
from chaos.daemon.config import DaemonConfig

from chaos.protocol import BulkAck, BulkData, ConnectCommand, LinkReport, Ping, Pong

CHUNK = 64 << 10


class _Host:
    node_id = "a"
    epoch = 3
    term = 1

    def __init__(self) -> None:
        self.sent: list[tuple[str, Any, bytes | None]] = []
        self.reports: list[Any] = []
        self.events: list[tuple[str, dict[str, object]]] = []

    def send(self, peer: str, msg: Any, attachment: bytes | None = None) -> bool:
        self.sent.append((peer, msg, attachment))
        return True

    def to_scheduler(self, msg: Any) -> bool:
        self.reports.append(msg)
        return True

    def connect_peer(self, peer: str, address: str) -> bool:
        return True  # a connection that is already up: every ping goes out at once

    def event(self, name: str, **fields: object) -> None:
        self.events.append((name, fields))

    def chunks(self) -> list[BulkData]:
        return [m for _, m, _ in self.sent if isinstance(m, BulkData)]


def _agent() -> tuple[Agent, _Host]:
    cfg = DaemonConfig(
        node_id="a",
        listen="tcp://127.0.0.1:5000",
        bandwidth_probe_bytes=8 * CHUNK,
        bandwidth_probe_chunk_bytes=CHUNK,
    )
    host = _Host()
    return Agent(host, cfg), host


def _measure(agent: Agent, host: _Host) -> None:
    """Orders a measurement of a-b and answers its pings, so that the bulk probe starts."""
    agent.on_connect(
        ConnectCommand(sender="s", epoch=3, term=1, peer="b", address="tcp://127.0.0.1:5001",
                       measure_bandwidth=True, op_id="refine-1"),  # fmt: skip
        0.0,
    )
    pings = [m for _, m, _ in host.sent if isinstance(m, Ping)]
    for p in pings:
        agent.on_pong(Pong(sender="b", epoch=3, seq=p.seq, t=p.t), p.t + 1e-4)


def _ack(agent: Agent, chunks: list[BulkData]) -> None:
    """The peer's answer to the last chunk of a stage."""
    agent.on_bulk_ack(
        BulkAck(sender="b", epoch=3, probe_id=chunks[-1].probe_id,
                received_bytes=sum(c.size for c in chunks)),  # fmt: skip
        0.0,
    )


def test_the_probe_sends_its_chunks_as_attachments_and_reports_the_rate() -> None:
    agent, host = _agent()
    _measure(agent, host)
    chunks = host.chunks()
    assert [c.index for c in chunks] == list(range(8)) and {c.count for c in chunks} == {8}
    # each chunk's bytes travel as the attachment, of the size the message declares
    sent = [(c, att) for _, c, att in host.sent if isinstance(c, BulkData)]
    assert all(att is not None and len(att) == c.size == CHUNK for c, att in sent)
    # an answer to another probe is not taken for this one
    agent.on_bulk_ack(BulkAck(sender="b", epoch=3, probe_id="b-99", received_bytes=1), 0.0)
    assert not [r for r in host.reports if isinstance(r, LinkReport)]
    _ack(agent, chunks)
    (report,) = [r for r in host.reports if isinstance(r, LinkReport)]
    assert report.up and report.peer == "b" and report.op_id == "refine-1"
    assert report.bandwidth_bps is not None and report.bandwidth_bps > 0
    assert not agent.measurements


def test_the_receiver_counts_attached_bytes_and_answers_the_last_chunk() -> None:
    agent, _ = _agent()
    chunk = BulkData(sender="b", epoch=3, probe_id="b-1", index=0, count=2, size=CHUNK)
    assert agent.on_bulk_data(chunk, 0.0) is None
    last = BulkData(sender="b", epoch=3, probe_id="b-1", index=1, count=2, size=CHUNK)
    ack = agent.on_bulk_data(last, 0.0)
    assert ack is not None and ack.probe_id == "b-1" and ack.received_bytes == 2 * CHUNK
