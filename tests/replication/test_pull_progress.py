"""A joiner's pull progress: ``pull_state`` reports every verified shard (real donor processes
over sockets), and :class:`PullProgress` shows it as a tqdm bar on a terminal and as log lines
elsewhere."""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

import pytest
from chaos.scheduling import plan_replication

from chaos.trainer.pull_progress import PullProgress
from tests.replication.test_replication import (  # the real donors and joiner of those tests
    _joiner,
    _neighbors,
    _pull,
    healthy_donors,  # noqa: F401 - a fixture
)


def test_every_verified_shard_is_reported_in_order(healthy_donors: dict[str, Any]) -> None:  # noqa: F811
    donors = healthy_donors
    state, _model, _opt = _joiner(donors["d0"])
    plan = plan_replication(state.tensor_sizes(), _neighbors(list(donors)), 1e-5, method="even")
    seen: list[tuple[int, int, dict[str, int]]] = []
    stats = _pull(donors, state, plan, max_request_bytes=5000,
                  on_progress=lambda d, t, per: seen.append((d, t, dict(per))))  # fmt: skip
    assert len(seen) == sum(stats.shards_per_donor.values()) > len(donors)
    done = [d for d, _, _ in seen]
    assert done == sorted(done) and done[-1] == state.total_bytes
    assert all(t == state.total_bytes for _, t, _ in seen)
    assert all(sum(per.values()) == d for d, _, per in seen)
    assert seen[-1][2] == stats.bytes_per_donor


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_pull_is_a_bar() -> None:
    term = _Terminal()
    progress = PullProgress("n7", interval_s=5.0, stream=term)
    assert progress.interactive
    for done in range(1, 11):
        progress(done * 100_000, 1_000_000, {"n1": done * 60_000, "n4": done * 40_000})
    progress.close()
    shown = term.getvalue()
    assert "n7 pulling: 100%" in shown and "1.00M/1.00M" in shown and "n1 0.6 MB" in shown
    assert progress.lines == 0


def test_without_a_terminal_the_pull_logs_a_line_every_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    plain = io.StringIO()
    progress = PullProgress("n7", interval_s=1e-9, stream=plain)
    assert not progress.interactive
    with caplog.at_level(logging.INFO, logger="chaos.trainer.pull"):
        progress(400_000, 1_000_000, {"n1": 400_000})
        progress(1_000_000, 1_000_000, {"n1": 600_000, "n4": 400_000})
        progress.close()
    assert plain.getvalue() == ""  # no bar
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and progress.lines == 3
    assert "n7: pulled 0.4 of 1.0 MB (40%" in lines[0]
    assert "from n1 0.6 MB, n4 0.4 MB" in lines[1]


def test_a_long_interval_still_logs_the_last_line(caplog: pytest.LogCaptureFixture) -> None:
    progress = PullProgress("n7", interval_s=3600.0, stream=io.StringIO())
    with caplog.at_level(logging.INFO, logger="chaos.trainer.pull"):
        for done in range(1, 6):
            progress(done * 200_000, 1_000_000, {"n1": done * 200_000})
        progress.close()
    assert [r.getMessage()[:30] for r in caplog.records] == ["n7: pulled 1.0 of 1.0 MB (100%"]


def test_the_listener_hears_every_step_and_the_end() -> None:
    heard: list[tuple[int, int, dict[str, int], bool]] = []
    progress = PullProgress(
        "n7", interval_s=3600.0, stream=io.StringIO(),
        listener=lambda d, t, per, last: heard.append((d, t, dict(per), last)),
    )  # fmt: skip
    progress(500, 1000, {"n1": 500})
    progress(1000, 1000, {"n1": 500, "n4": 500})
    progress.close()
    assert heard == [(500, 1000, {"n1": 500}, False), (1000, 1000, {"n1": 500, "n4": 500}, False),
                     (1000, 1000, {"n1": 500, "n4": 500}, True)]  # fmt: skip


def test_the_beacon_tells_the_daemon_of_the_pull(tmp_path: Path) -> None:
    """The trainer's one-way progress reports carry the pull (a real IPC socket stands in for
    the daemon's): at most one per interval, and always the last."""
    import zmq

    from chaos.protocol import TrainerProgress, decode
    from chaos.trainer.session import StepBeacon

    ctx = zmq.Context()
    daemon = ctx.socket(zmq.ROUTER)
    endpoint = f"ipc://{tmp_path / 'd.sock'}"
    daemon.bind(endpoint)
    beacon = StepBeacon(endpoint)
    try:
        beacon.pulling(100, 1000, {"n1": 100}, last=False)  # sent: the first
        beacon.pulling(200, 1000, {"n1": 200}, last=False)  # within the interval: not sent
        beacon.pulling(1000, 1000, {"n1": 600, "n4": 400}, last=True)  # the last: sent
        got = []
        while len(got) < 2 and daemon.poll(2000):
            msg = decode(daemon.recv_multipart()[-1])
            assert isinstance(msg, TrainerProgress)
            got.append(msg.pulling)
        assert [(p.pulled_bytes, p.total_bytes) if p else None for p in got] == [
            (100, 1000), (1000, 1000)]  # fmt: skip
        assert got[1] is not None and got[1].donors == {"n1": 600, "n4": 400}
        assert not daemon.poll(300)  # the report within the interval was not sent
    finally:
        beacon.close()
        daemon.close(linger=0)
        ctx.term()
