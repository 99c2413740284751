"""The node agent's bandwidth probe, without sockets: what it sends and what it reports.

The daemon around the agent is a recording stand-in (the transport is not under test here);
the probe's wire format is checked in ``test_protocol_config.py`` and ``test_fuzz.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
from chaos.daemon.agent import Agent
from chaos.daemon.config import DaemonConfig

from chaos.protocol import BulkAck, BulkData, ConnectCommand, LinkReport, Ping, Pong

CHUNK = 64 << 10


class _Host:
    node_id = "a"
    epoch = 3
    term = 1
    trains = False

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


def _agent(trains: bool = False, wait_s: float = 2.0) -> tuple[Agent, _Host]:
    cfg = DaemonConfig(
        node_id="a",
        listen="tcp://127.0.0.1:5000",
        bandwidth_probe_bytes=8 * CHUNK,
        bandwidth_probe_chunk_bytes=CHUNK,
        probe_round_wait_s=wait_s,
    )
    host = _Host()
    host.trains = trains
    return Agent(host, cfg), host


def _measure(agent: Agent, host: _Host, after_round: bool = False) -> None:
    """Orders a measurement of a-b and answers its pings, so that the bulk probe starts (or,
    ``after_round`` on a training node, waits for the trainer's round)."""
    agent.on_connect(
        ConnectCommand(sender="s", epoch=3, term=1, peer="b", address="tcp://127.0.0.1:5001",
                       measure_bandwidth=True, op_id="refine-1",
                       after_round=after_round),  # fmt: skip
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


def test_a_refinement_on_a_training_node_waits_for_the_trainers_round() -> None:
    agent, host = _agent(trains=True)
    _measure(agent, host, after_round=True)
    assert not host.chunks() and agent.wants_round  # waiting: the notice asks the trainer
    agent.tick_measurements(1.9)  # within probe_round_wait_s: still waiting, not timed out
    assert not host.chunks() and agent.measurements
    agent.on_round_done(1.9)
    assert len(host.chunks()) == 8 and not agent.wants_round
    (started,) = [f for name, f in host.events if name == "bulk_probe_started"]
    assert started["cause"] == "round_done" and started["op_id"] == "refine-1"
    assert started["waited_s"] == pytest.approx(1.9, abs=1e-3)  # since the last pong
    agent.on_round_done(2.0)  # a late or repeated report starts nothing more
    assert len(host.chunks()) == 8
    _ack(agent, host.chunks())
    assert [r.op_id for r in host.reports if isinstance(r, LinkReport)] == ["refine-1"]


def test_without_a_round_the_probe_starts_when_the_wait_ends_and_keeps_its_full_timeout() -> None:
    agent, host = _agent(trains=True, wait_s=4.0)
    _measure(agent, host, after_round=True)
    agent.tick_measurements(3.9)
    assert not host.chunks()
    agent.tick_measurements(4.01)
    assert len(host.chunks()) == 8 and not agent.wants_round
    assert [f["cause"] for name, f in host.events if name == "bulk_probe_started"] == [
        "wait_expired"
    ]
    # the wait did not eat the measurement's probe_timeout_s (5 s from the start, so 9 s now)
    agent.tick_measurements(8.9)
    assert agent.measurements and not host.reports


@pytest.mark.parametrize(
    ("trains", "after_round", "wait_s"),
    [(False, True, 2.0), (True, False, 2.0), (True, True, 0.0)],
    ids=["no-trainer", "not-a-refinement", "wait-off"],
)
def test_the_probe_starts_at_once_otherwise(trains: bool, after_round: bool, wait_s: float) -> None:
    agent, host = _agent(trains=trains, wait_s=wait_s)
    _measure(agent, host, after_round=after_round)
    assert len(host.chunks()) == 8 and not agent.wants_round
    assert [f["cause"] for name, f in host.events if name == "bulk_probe_started"] == ["at_once"]
