"""The online state audit with real processes: three members, one bit flipped on one of them.

The audit (``audit_every`` steps) must find the flipped member at its next audit, that member
must emit ``state_diverged`` and pull the state again, and from then on every member's model and
optimizer state must be bitwise equal.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.trainer_cluster import Cluster, Member, assert_equal_from, world

AUDIT_EVERY = 5
WORKER = Path(__file__).with_name("audit_worker.py")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, WORKER)
    try:
        yield c
    finally:
        c.close()


def _events(m: Member, kind: str) -> list[dict[str, Any]]:
    return [r for r in m.records() if r.get("event") == kind]


def test_a_flipped_bit_is_caught_and_healed(cluster: Cluster) -> None:
    every = ("--audit-every", str(AUDIT_EVERY))
    a = cluster.start("a", None, *every)
    cluster.wait(lambda: a.last(), "the founder's first step")
    b = cluster.start("b", a, *every)
    c = cluster.start("c", a, *every)
    members = [a, b, c]
    cluster.wait(lambda: all(world(m, 3) for m in members), "three members training")
    c.out.with_suffix(".flip").touch()
    flipped = cluster.wait(lambda: _events(c, "bit_flipped"), "the bit flip")[0]["step"]
    diverged = cluster.wait(lambda: _events(c, "state_diverged"), "state_diverged on c")[0]
    # caught by the first audit at or after the flip: within audit_every steps
    assert flipped <= diverged["audit_step"] <= flipped + AUDIT_EVERY
    assert diverged["odd"] == ["c"] and diverged["first_step"] == diverged["audit_step"]
    healed = cluster.wait(lambda: _events(c, "state_healed"), "c pulled the state again")[0]
    assert healed["pulled_bytes"] is not None and healed["pulled_bytes"] < healed["state_bytes"]
    # the flip was real: c's state differed from a's from the flip on, until the heal
    da, dc = a.digests(), c.digests()
    assert dc[flipped] != da[flipped]
    assert not _events(a, "state_diverged") and not _events(b, "state_diverged")
    end = healed["step"] + 3 * AUDIT_EVERY
    cluster.wait(lambda: all(m.last().get("step", 0) >= end for m in members),
                 "three more audits after the heal")  # fmt: skip
    # the daemon's status shows its trainer's audit (typed field of its progress reports)
    st = cluster.wait(lambda: _status_audit(c), "c's daemon to show the audit")
    assert st["healed"] == 1 and st["mismatches"] >= 1 and st["step"] > diverged["audit_step"]
    for m in members:
        m.leave()
    cluster.wait(lambda: all(any("audit" in r for r in m.records()) for m in members),
                 "the audit records")  # fmt: skip
    assert assert_equal_from(members, healed["step"] + 1) >= 2 * AUDIT_EVERY
    audits = {m.id: next(r["audit"] for r in m.records() if "audit" in r) for m in members}
    assert audits["c"]["healed"] == 1 and audits["a"]["healed"] == 0
    for rec in audits.values():
        assert rec["mismatches"] >= 1 and rec["audits"] >= 3 and rec["agreed"] is True


def _status_audit(m: Member) -> dict[str, Any] | None:
    """The ``audit`` of ``chaos-daemon status --json`` at ``m``'s daemon, once it healed."""
    cmd = [sys.executable, "-m", "chaos.daemon.cli", "status", "--json", "--connect", m.address]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if run.returncode != 0:
        return None
    audit = json.loads(run.stdout).get("audit")
    return audit if audit and audit["healed"] >= 1 and audit["agreed"] else None
