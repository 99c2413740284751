"""``doctor``: a daemon's checks of its own setup, against live daemons.

A healthy member says so (the missing trainer is only a warning); a member cut off from the
majority says it pauses and which links are down, worst first, with what to do. The CLI prints
the same and exits non-zero when a check fails. Every process is killed and reaped when its
test ends.
"""

from __future__ import annotations

import json

from chaos.daemon.client_ops import call_doctor
from daemon_helpers import Cluster, Node, wait_until

from chaos.protocol.messages import DoctorReply


def _doctor(node: Node) -> DoctorReply:
    with node.local_client() as c:
        return call_doctor(c, timeout_s=5.0)


def _by_name(reply: DoctorReply) -> dict[str, str]:
    return {c.name: c.status for c in reply.checks}


def test_a_healthy_member_passes_its_checks(cluster: Cluster) -> None:
    n1, n2, _ = cluster.start(3)
    assert _by_name(_doctor(n2)) == {"membership": "ok", "address": "ok", "scheduler": "ok",
                                     "links": "ok", "trainer": "warn"}  # fmt: skip
    reply = _doctor(n1)
    scheduler = next(c for c in reply.checks if c.name == "scheduler")
    assert "this node is the scheduler" in scheduler.detail
    trainer = reply.checks[0]  # worst first: the one warning
    assert trainer.name == "trainer" and trainer.fix
    done = cluster.cli(n2, "doctor", "--json")
    assert done.returncode == 0, done.stderr
    assert {c["name"]: c["status"] for c in json.loads(done.stdout)["checks"]} == _by_name(
        _doctor(n2)
    )


def test_a_member_cut_off_from_the_majority_says_what_is_wrong(cluster: Cluster) -> None:
    n1, n2, n3 = cluster.start(3)
    cluster.kill9(n1)
    cluster.kill9(n3)
    wait_until(lambda: n2.status().paused, "n2 pauses")

    def links_down() -> DoctorReply | None:
        reply = _doctor(n2)
        return reply if _by_name(reply)["links"] == "warn" else None

    reply = wait_until(links_down, "n2's links to the dead reported down")
    worst = reply.checks[0]
    assert worst.name == "scheduler" and worst.status == "fail" and "paused" in worst.detail
    assert worst.fix
    links = next(c for c in reply.checks if c.name == "links")
    assert "n1" in links.detail or "n3" in links.detail
    done = cluster.cli(n2, "doctor")
    assert done.returncode == 1
    assert "FAIL scheduler: paused" in done.stdout and "fix:" in done.stdout
