"""The node agent's bandwidth probe, without sockets: its two stages and what it reports.

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


def _agent(fast_bps: float) -> tuple[Agent, _Host]:
    cfg = DaemonConfig(
        node_id="a",
        listen="tcp://127.0.0.1:5000",
        bandwidth_probe_bytes=8 * CHUNK,
        bandwidth_probe_chunk_bytes=CHUNK,
        bandwidth_probe_first_bytes=2 * CHUNK,
        bandwidth_probe_fast_bps=fast_bps,
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


def test_a_fast_link_is_measured_by_the_first_stage_alone() -> None:
    agent, host = _agent(fast_bps=1.0)  # any rate counts as fast
    _measure(agent, host)
    first = host.chunks()
    assert [c.index for c in first] == [0, 1] and {c.count for c in first} == {2}
    # the chunk's bytes travel as the attachment, declared by size
    assert all(att is not None and len(att) == c.size == CHUNK for (_, c, att) in
               [s for s in host.sent if isinstance(s[1], BulkData)])  # fmt: skip
    _ack(agent, first)
    (report,) = [r for r in host.reports if isinstance(r, LinkReport)]
    assert report.up and report.peer == "b" and report.bandwidth_bps and report.bandwidth_bps > 0
    assert len(host.chunks()) == 2 and not agent.measurements


def test_a_slower_link_gets_the_rest_as_a_second_stage_timed_on_its_own() -> None:
    agent, host = _agent(fast_bps=1e18)  # nothing is that fast
    _measure(agent, host)
    first = host.chunks()
    _ack(agent, first)
    assert not [r for r in host.reports if isinstance(r, LinkReport)]  # not done yet
    second = host.chunks()[len(first) :]
    assert len(second) == 6 and {c.count for c in second} == {6}  # 8 chunks in all
    assert second[0].probe_id != first[0].probe_id
    # a late or repeated answer to the first stage is not taken for the second
    _ack(agent, first)
    assert not [r for r in host.reports if isinstance(r, LinkReport)]
    _ack(agent, second)
    (report,) = [r for r in host.reports if isinstance(r, LinkReport)]
    assert report.up and report.bandwidth_bps and report.bandwidth_bps > 0
    assert len(host.chunks()) == 8 and not agent.measurements


def test_one_stage_when_the_first_stage_is_the_whole_probe() -> None:
    agent, host = _agent(fast_bps=1e18)
    agent.cfg = DaemonConfig(**{**agent.cfg.__dict__, "bandwidth_probe_first_bytes": 8 * CHUNK})
    _measure(agent, host)
    chunks = host.chunks()
    assert len(chunks) == 8
    _ack(agent, chunks)
    assert [r for r in host.reports if isinstance(r, LinkReport)][0].bandwidth_bps


def test_a_first_stage_larger_than_the_probe_is_refused() -> None:
    import pytest

    from chaos.errors import ConfigError

    with pytest.raises(ConfigError, match="bandwidth_probe_first_bytes"):
        DaemonConfig(node_id="a", listen="tcp://127.0.0.1:5000", bandwidth_probe_bytes=CHUNK,
                     bandwidth_probe_first_bytes=2 * CHUNK)  # fmt: skip
    with pytest.raises(ConfigError, match="bandwidth_probe_fast_bps"):
        DaemonConfig(node_id="a", listen="tcp://127.0.0.1:5000", bandwidth_probe_fast_bps=0.0)
