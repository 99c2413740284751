"""``chaos-bench join-load``'s launcher: a trainer still pending at a run's deadline is recorded
with where it was (its threads' stacks), not only that it timed out. A real worker process,
joining an address where nothing listens, so that it cannot step."""

from __future__ import annotations

import sys
from pathlib import Path

from chaos.bench.join_load import _Run
from chaos.launch import free_tcp_address


def test_a_pending_trainer_is_recorded_with_its_stacks(tmp_path: Path) -> None:
    run = _Run(sys.executable, tmp_path)
    try:
        run.start_trainer("n1", free_tcp_address(), free_tcp_address())  # nobody at the join
        got = run.wait(("n1",), timeout_s=15.0)["n1"]
    finally:
        run.close()
    assert not got["stepped"]
    error = got["error"]
    assert error.startswith("no step within the run's deadline of 15.0 s; where it was:")
    assert "most recent call first" in error and "in wait_ready" in error, error  # the stacks
