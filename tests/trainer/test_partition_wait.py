"""A trainer never gives up on a cluster that can heal.

Three real training processes; the minority one is cut off from the other two by a partition
(named faults on every embedded daemon) for longer than any old policy timeout. The majority
goes on; the minority's ``update()`` waits, reporting ``waiting`` events, and after the heal it
joins again, pulls the current state and trains on with the others, bitwise equal.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from chaos.daemon.client import DaemonClient
from chaos.daemon.config import ipc_endpoint_for

from tests.trainer.trainer_cluster import (
    DAEMON_ARGS,
    Cluster,
    assert_equal_from,
    in_order,
    world,
)

FAULT_ARGS = (*DAEMON_ARGS, "--enable-fault-injection")
PARTITION_S = 15.0


class PartitionCluster(Cluster):
    """Workers whose embedded daemons accept named faults, in known run directories."""

    daemon_args = FAULT_ARGS

    def node_args(self, node_id: str) -> list[str]:
        return ["--daemon-dir", str(self.run_dir(node_id)), "--stall-progress", "1.0"]

    def run_dir(self, node_id: str) -> Path:
        return self.tmp / f"{node_id}.daemon"

    def fault(self, node_id: str, name: str, peers: list[str]) -> None:
        with DaemonClient(ipc_endpoint_for(str(self.run_dir(node_id))), timeout_s=5.0) as c:
            c.fault(name, peers)  # type: ignore[arg-type]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[PartitionCluster]:
    with contextlib.closing(PartitionCluster(tmp_path)) as c:
        yield c


def test_a_partitioned_minority_waits_and_rejoins_after_the_heal(
    cluster: PartitionCluster,
) -> None:
    a = cluster.start("a")
    cluster.wait(lambda: a.last().get("step", 0) >= 3, "a to train")
    b = cluster.start("b", a)
    cluster.wait(lambda: world(a, 2) and world(b, 2), "b to join")
    c = cluster.start("c", b)
    cluster.wait(lambda: all(world(m, 3) for m in (a, b, c)), "c to join")
    for node in ("a", "b"):
        cluster.fault(node, "partition", ["a", "b"])
    cluster.fault("c", "partition", ["c"])
    cut_at_t = time.monotonic()
    cut_at = max(a.digests())
    cluster.wait(lambda: world(a, 2, cut_at + 5) and world(b, 2, cut_at + 5),
                 "the majority to go on as two")  # fmt: skip
    c_step = max(c.digests())
    # the partition lasts 15 s, well past the 10 s that a step used to wait before it gave up
    lasts_until = cut_at_t + PARTITION_S
    cluster.wait(lambda: time.monotonic() >= lasts_until, "the partition's duration")
    assert c.proc.poll() is None, c.log()
    assert max(c.digests()) == c_step, "the minority trained while cut off"
    for node in ("a", "b", "c"):
        cluster.fault(node, "clear", [])
    healed_at = max(a.digests())
    cluster.wait(lambda: all(world(m, 3, healed_at + 5) for m in (a, b, c)),
                 "c to rejoin and all three to train")  # fmt: skip
    waits = [r for r in c.records() if r.get("event") == "waiting"]
    assert waits and max(r["waited_s"] for r in waits) >= 12.0, waits  # it said it waited
    # its lifecycle: cut off, it waited (paused, when it heard its daemon say so); evicted
    # meanwhile, it joined again at the heal and pulled the state
    phases = c.phases()
    assert in_order(phases, ["live", "rejoining", "joining", "pulling", "live"]), phases
    if any(w["paused"] for w in waits):
        assert in_order(phases, ["live", "paused", "rejoining"]), (phases, waits)
    first_c = min(s for s in c.digests() if s > healed_at)
    cluster.wait(lambda: all(world(m, 3, first_c + 5) for m in (a, b, c)),
                 "five more steps as three")  # fmt: skip
    assert assert_equal_from([a, b, c], first_c) >= 3
