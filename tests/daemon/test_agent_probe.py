"""The node agent's bandwidth probe, without sockets: what it sends and what it reports.

The daemon around the agent is a recording stand-in (the transport is not under test here);
the probe's wire format is checked in ``test_protocol_config.py`` and ``test_fuzz.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
from chaos.daemon.agent import Agent, LinkProbe
from chaos.daemon.config import DaemonConfig

from chaos.errors import ConfigError
from chaos.protocol import BulkAck, BulkData, ConnectCommand, LinkReport, Ping, Pong
from tests.daemon.recorder import Recorder, recording_context

CHUNK = 64 << 10


class _Host(Recorder):
    """The agent's outbox and event log, recording each message with its attachment."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, Any, bytes | None]] = []  # type: ignore[assignment]

    def send(self, peer: str, msg: Any, attachment: bytes | None = None) -> bool:
        self.sent.append((peer, msg, attachment))
        return True

    @property
    def reports(self) -> list[Any]:
        return self.to_sched

    def chunks(self) -> list[BulkData]:
        return [m for _, m, _ in self.sent if isinstance(m, BulkData)]


def _with(host: _Host, cfg: DaemonConfig) -> Agent:
    return Agent(recording_context(cfg, host)[0], cfg)


def _agent() -> tuple[Agent, _Host]:
    cfg = DaemonConfig(
        node_id="a",
        listen="tcp://127.0.0.1:5000",
        bandwidth_probe_bytes=8 * CHUNK,
        bandwidth_probe_chunk_bytes=CHUNK,
    )
    host = _Host()
    return _with(host, cfg), host


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


def _cmd(op_id: str, measure_bandwidth: bool) -> ConnectCommand:
    return ConnectCommand(sender="s", epoch=3, term=1, peer="b", address="tcp://127.0.0.1:5001",
                          measure_bandwidth=measure_bandwidth, op_id=op_id)  # fmt: skip


def _pings(host: _Host) -> list[Ping]:
    return [m for _, m, _ in host.sent if isinstance(m, Ping)]


def _latency_first(agent: Agent, host: _Host, now: float) -> None:
    """A connect-link's first measurement: latency only, every ping answered 2 ms later."""
    agent.on_connect(_cmd("pre-1", measure_bandwidth=False), now)
    for p in _pings(host):
        agent.on_pong(Pong(sender="b", epoch=3, seq=p.seq, t=p.t), p.t + 0.002)
    (report,) = [r for r in host.reports if r.op_id == "pre-1"]
    assert report.up and report.latency_s == pytest.approx(0.001) and report.bandwidth_bps is None
    host.sent.clear()


def test_a_bandwidth_probe_right_after_a_latency_measurement_sends_no_pings() -> None:
    agent, host = _agent()
    _latency_first(agent, host, now=100.0)
    agent.on_connect(_cmd("refine-1", measure_bandwidth=True), 101.0)
    # the transfer starts at once: the round trip measured a second ago is reused
    assert not _pings(host) and len(host.chunks()) == 8
    _ack(agent, host.chunks())
    (report,) = [r for r in host.reports if r.op_id == "refine-1"]
    assert report.up and report.latency_s == pytest.approx(0.001) and report.bandwidth_bps
    name, fields = host.events[-1]
    assert name == "link_measured" and fields["pinged"] is False


def test_a_stale_latency_is_measured_again_before_the_transfer() -> None:
    agent, host = _agent()
    _latency_first(agent, host, now=100.0)
    agent.on_connect(_cmd("refine-1", measure_bandwidth=True), 100.0 + 60.0)
    assert len(_pings(host)) == 3 and not host.chunks()  # pings first, as for a new link


def test_a_probe_without_pings_that_is_never_answered_reports_the_link_down() -> None:
    agent, host = _agent()
    _latency_first(agent, host, now=100.0)
    agent.on_connect(_cmd("refine-1", measure_bandwidth=True), 101.0)
    assert host.chunks() and not _pings(host)
    agent.tick_measurements(101.0 + agent.cfg.probe_timeout_s + 0.1)  # no bulk ack came
    (report,) = [r for r in host.reports if r.op_id == "refine-1"]
    assert not report.up and report.bandwidth_bps is None
    assert not agent.measurements


def test_a_measured_link_probes_latency_is_reused_by_a_later_bandwidth_probe() -> None:
    agent, host = _agent()
    agent.links["b"] = LinkProbe("b", up=True, last_pong=0.0, latency_s=0.004)
    agent.on_connect(_cmd("confirm-1", measure_bandwidth=True), 5.0)
    assert not _pings(host) and host.chunks()
    _ack(agent, host.chunks())
    (report,) = [r for r in host.reports if r.op_id == "confirm-1"]
    assert report.latency_s == 0.004


@pytest.mark.parametrize("keep", [True, False])
def test_the_agent_keeps_probe_memory_only_when_configured(
    keep: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    monkeypatch.setattr("chaos.daemon.agent.keep_frame_memory", calls.append)
    cfg = DaemonConfig(
        node_id="a",
        listen="tcp://127.0.0.1:5000",
        bandwidth_probe_chunk_bytes=CHUNK,
        keep_probe_memory=keep,
    )
    _with(_Host(), cfg)
    assert calls == ([CHUNK] if keep else [])


def test_keep_probe_memory_must_be_a_bool() -> None:
    with pytest.raises(ConfigError, match="keep_probe_memory"):
        DaemonConfig(node_id="a", listen="tcp://127.0.0.1:5000", keep_probe_memory="yes")  # type: ignore[arg-type]
