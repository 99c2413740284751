"""A joiner whose cluster key the cluster refuses (another key, or none) says so at once,
instead of waiting out its join timeout.

Every daemon is a real ``chaos-daemon`` process on loopback, killed and reaped when the test ends
(the ``cluster`` fixture).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from chaos.daemon.client import DaemonClient
from daemon_helpers import Cluster, wait_until

from chaos.security import ClusterKey, Security

_EXIT_S = 60.0
_REFUSED = "the cluster refused our key (another cluster key?)"


def _keyed_founder(cluster: Cluster, key: Path) -> str:
    n1 = cluster.spawn("n1", extra=("--cluster-key", str(key)), wait=False)
    sec = Security.from_key_file(key)

    def active() -> bool:
        with DaemonClient(n1.address, timeout_s=2.0, security=sec) as c:
            return c.status().state == "active"

    wait_until(active, "n1 active")
    return n1.address


@pytest.mark.parametrize("joiner_key", ["another", "none"])
def test_a_joiner_with_a_refused_key_says_so(
    cluster: Cluster, tmp_path: Path, joiner_key: str
) -> None:
    key = ClusterKey.generate().write(tmp_path / "cluster.key")
    n1 = _keyed_founder(cluster, key)
    extra: tuple[str, ...] = ("--join-timeout", "600")
    if joiner_key == "another":
        other = ClusterKey.generate().write(tmp_path / "other.key")
        extra += ("--cluster-key", str(other))
    founder = cluster.nodes["n1"]
    assert founder.address == n1
    joiner = cluster.spawn("n2", join=founder, extra=extra, wait=False)
    code = joiner.proc.wait(timeout=_EXIT_S)  # long before the 600 s join timeout
    log = (joiner.run_dir / "stderr.log").read_text()
    assert code == 3, log
    assert _REFUSED in log, log
    assert "join timed out" not in log
    assert [e for e in joiner.events() if e["event"] == "join_failed"][-1]["detail"] == _REFUSED
