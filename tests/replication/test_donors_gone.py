"""A join whose donors all go away fails at once with "no donor left", not at its timeout.

The donors are real processes serving real :class:`ShardServer` s (the helpers of
``test_replication.py``); the joiner is this process. Timeouts are set far beyond the test's
run so that a pull that waited for them would end in a ``ChaosTimeout``: the tests check the
reason of the failure, never its duration.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import torch
from test_replication import (  # the donor processes and joiner helpers of that module
    EPOCH,
    Donor,
    _donor_pool,
    _joiner,
    _plan,
    _pull,
)

from chaos.errors import ReplicationError
from chaos.launch import wait_until
from chaos.replication.donor_requests import DonorUnreachable, gather_manifests, latest_manifest
from chaos.replication.pull import PullConfig


@pytest.fixture
def donors_of() -> Iterator[Callable[..., dict[str, Donor]]]:
    """Starts donor processes of one test; reaps them all at the end."""
    with _donor_pool() as start:
        yield start


LONG_S = 600.0  # far longer than the test: reaching it would be a ChaosTimeout
GUARD_S = 120.0  # only against a hang


def _kill(donors: dict[str, Donor]) -> None:
    for d in donors.values():
        os.kill(d.proc.pid, signal.SIGKILL)
    for d in donors.values():
        d.proc.join(30.0)


def _in_thread(fn: Callable[[], Any]) -> Future[Any]:
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(fn)
    pool.shutdown(wait=False)
    return future


def test_asking_a_gone_donor_for_its_manifest_says_it_is_gone(donors_of: Any) -> None:
    donors = donors_of({"d0": {}})
    _kill(donors)
    with pytest.raises(DonorUnreachable, match="refuses connections"):
        latest_manifest(donors["d0"].address, EPOCH, timeout_s=LONG_S)


def test_waiting_for_manifests_fails_when_every_donor_leaves(donors_of: Any) -> None:
    # the donors have not published yet (still finishing their step) when they go away
    donors = donors_of({"d0": {"publish_after_s": 300.0}, "d1": {"publish_after_s": 300.0}})
    asked = threading.Event()
    addresses = {nid: d.address for nid, d in donors.items()}

    def gather() -> Any:
        asked.set()
        return gather_manifests(addresses, EPOCH, LONG_S, 0.02)

    future = _in_thread(gather)
    asked.wait(GUARD_S)
    _kill(donors)
    with pytest.raises(ReplicationError, match="no donor left") as info:
        future.result(timeout=GUARD_S)
    assert info.value.failed_donors == {"d0": "unreachable", "d1": "unreachable"}


def test_a_pull_whose_donors_all_leave_mid_transfer_fails_with_no_donor_left(
    donors_of: Any,
) -> None:
    # each donor sends one shard, then hangs (alive, silent) until it is killed
    donors = donors_of({"d0": {"stall_after_shards": 1}, "d1": {"stall_after_shards": 1}})
    state, model, _ = _joiner(donors["d0"])
    before = [p.detach().clone() for p in model.parameters()]
    plan = _plan(state, list(donors))

    future = _in_thread(
        lambda: _pull(donors, state, plan, LONG_S, window=1, request_timeout_s=LONG_S)
    )

    def some_shard_arrived() -> bool:
        return any(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))

    wait_until(some_shard_arrived, GUARD_S, "a first shard to arrive", poll_s=0.02)
    _kill(donors)
    with pytest.raises(ReplicationError, match="no donor left") as info:
        future.result(timeout=GUARD_S)
    assert set(info.value.failed_donors) == {"d0", "d1"}
    assert set(info.value.failed_donors.values()) <= {"disconnected", "unreachable"}


def test_a_pull_whose_donors_left_before_it_began_fails_with_no_donor_left(
    donors_of: Any,
) -> None:
    donors = donors_of({"d0": {}, "d1": {}})
    state, _, _ = _joiner(donors["d0"])
    plan = _plan(state, list(donors))
    _kill(donors)
    with pytest.raises(ReplicationError, match="no donor left") as info:
        _pull(donors, state, plan, LONG_S, window=PullConfig.window, request_timeout_s=LONG_S)
    assert info.value.failed_donors == {"d0": "unreachable", "d1": "unreachable"}
