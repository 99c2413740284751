"""Local-steps mode with real processes: members that synchronise only at outer boundaries.

Each worker (``local_worker.py``) is a real member with its embedded daemon on loopback; it
appends one JSON line per outer boundary with a digest of the global parameters and the outer
optimizer's state. Tests wait for conditions with generous deadlines and kill and reap every
process group at the end.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from chaos.launch import kill_and_reap
from tests.trainer.trainer_cluster import Cluster, Member, assert_equal_from, world

LOCAL_WORKER = Path(__file__).with_name("local_worker.py")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with contextlib.closing(Cluster(tmp_path, LOCAL_WORKER)) as c:  # reaped even on failure
        yield c


def _outer(member: Member) -> list[dict[str, Any]]:
    return [r for r in member.records() if "digest" in r]


def test_global_state_stays_equal_through_a_join_a_kill_and_a_leave(cluster: Cluster) -> None:
    """A founder trains alone; b joins; c joins and is killed in an outer allreduce; d joins
    and is killed (SIGKILL, most likely in its inner phase); b leaves.
    At every outer step two members both recorded, their global parameters and outer
    optimizer state (Nesterov SGD's momentum) are bitwise equal, and the joiners took part
    in outer steps with their own samples."""
    inner = ("--inner-steps", "6", "--inner-sleep", "0.02")
    a = cluster.start("a", None, *inner)
    cluster.wait(lambda: a.last().get("step", 0) >= 3, "a to take outer steps alone")
    b = cluster.start("b", a, *inner)
    cluster.wait(lambda: world(a, 2) and world(b, 2), "b to join a")
    c = cluster.start("c", b, *inner, "--die-after", "4")
    cluster.wait(lambda: c.proc.poll() is not None, "c to join, train and die mid-allreduce")
    assert c.proc.returncode == 70, c.log()
    died = max(c.digests())
    cluster.wait(lambda: world(a, 2, died + 3) and world(b, 2, died + 3), "a and b go on")
    assert any(r["world"] == 3 for r in _outer(a)), "c never took part in an outer step"
    assert any(r["world"] == 3 and r["live"] and r["samples"] > 0 for r in _outer(c))
    d = cluster.start("d", a, *inner)  # then killed (SIGKILL), most likely in an inner phase
    cluster.wait(lambda: world(a, 3, died) and world(d, 3), "d to join")
    kill_and_reap([d.proc], group=True)
    del cluster.members["d"]  # its exit is the test's doing, not a failure to watch for
    killed = max(d.digests())
    cluster.wait(lambda: world(a, 2, killed + 3) and world(b, 2, killed + 3), "a, b go on")
    b.leave()
    cluster.wait(lambda: any(r.get("left") for r in b.records()), "b to leave")
    left = max(b.digests())
    cluster.wait(lambda: world(a, 1, left + 2), "a to go on alone")
    assert assert_equal_from([a, c], min(c.digests())) >= 2
    assert assert_equal_from([a, d], min(d.digests())) >= 1
    assert assert_equal_from([a, b], min(b.digests())) >= 8
    # the outer optimizer's momentum is in the digest: Nesterov SGD really keeps a buffer
    assert len({r["digest"] for r in _outer(a)}) == len(_outer(a))
    # the online audit compared the global state at every outer step, and never found a
    # member different
    for m in (a, b, c, d):
        assert _outer(m)[-1]["audits"] >= 1, m.id
        assert all(r["mismatches"] == 0 for r in _outer(m)), m.id


def test_a_slow_member_takes_fewer_inner_steps_and_nobody_waits(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Three members bound their inner phase by 2.5 s of wall time (and 10,000 steps, never
    reached); one sleeps 0.6 s per inner step, the others 0.01 s. The slow one takes a few
    inner steps per phase while the others take many; the fast ones wait in the outer sync
    about one slow inner step at most, not a phase, also at the outer steps where b and the
    slow member joined; and the new global parameters are the
    sample-weighted mean of the members' local parameters (the outer optimizer is plain SGD
    with lr 1 here, so the outer step is exactly that mean)."""
    dump = ("--plain-outer", "--dump-dir", str(tmp_path / "dumps"))
    bound = ("--inner-steps", "10000", "--inner-time", "2.5")
    a = cluster.start("a", None, *bound, *dump)
    cluster.wait(lambda: a.last().get("step", 0) >= 1, "a to train")
    b = cluster.start("b", a, *bound, *dump)
    cluster.wait(lambda: world(a, 2) and world(b, 2), "b to join")
    slow = cluster.start("s", a, *bound, *dump, "--inner-sleep", "0.6")
    cluster.wait(lambda: world(a, 3) and world(slow, 3), "the slow member to join")
    first = max(m.last()["step"] for m in (a, b, slow))
    cluster.wait(lambda: all(world(m, 3, first + 4) for m in (a, b, slow)), "4 outer steps of 3")
    in_three = {m.id: [r for r in _outer(m) if r["world"] == 3 and r["step"] > first + 1
                       and r["live"]] for m in (a, b, slow)}  # fmt: skip
    slow_steps = [r["inner_steps"] for r in in_three["s"]]
    fast_steps = [r["inner_steps"] for m in ("a", "b") for r in in_three[m]]
    assert max(slow_steps) <= 5, slow_steps  # 2.5 s / 0.6 s, plus the step that crosses it
    assert statistics.median(fast_steps) >= 2 * statistics.median(slow_steps), (fast_steps,
                                                                                 slow_steps)
    waits = [r["sync_s"] for m in ("a", "b") for r in in_three[m]]
    assert statistics.median(waits) < 1.2, waits  # about one slow inner step (0.6 s)
    assert max(waits) < 2.0, waits  # never a whole phase (2.5 s)
    # nor when b and s joined: a joiner takes part in the round in progress contributing
    # nothing, so nobody waits for a whole inner phase of the joiner's
    joins = [r["sync_s"] for r in _outer(a)]
    assert max(joins) < 2.0, joins
    checked = _check_weighted_mean(tmp_path / "dumps", ["a", "b", "s"])
    assert checked >= 3
    assert assert_equal_from([a, b, slow], first) >= 4


def test_a_global_batch_split_by_speed_ends_every_phase_at_about_the_same_time(
    cluster: Cluster,
) -> None:
    """With ``global_batch`` 480 and no time bound, the scheduler splits the outer step's
    samples by the members' measured speed: the slow member (0.3 s per inner step) gets a
    small share and its phase ends after a few inner steps, the fast ones get the rest, and
    nobody waits a slow member's whole even share (60 steps of 0.3 s = 18 s)."""
    bound = ("--inner-steps", "10000", "--global-batch", "480")
    a = cluster.start("a", None, *bound)
    cluster.wait(lambda: a.last().get("step", 0) >= 1, "a to train")
    b = cluster.start("b", a, *bound)
    cluster.wait(lambda: world(a, 2) and world(b, 2), "b to join")
    slow = cluster.start("s", a, *bound, "--inner-sleep", "0.3")
    cluster.wait(lambda: world(a, 3) and world(slow, 3), "the slow member to join")

    def split_by_speed() -> bool:
        last = slow.last()
        return last.get("world") == 3 and last.get("budget") is not None and last["budget"] < 60

    cluster.wait(split_by_speed, "the split to give the slow member less than an even share")
    first = max(m.last()["step"] for m in (a, b, slow))
    cluster.wait(lambda: all(world(m, 3, first + 3) for m in (a, b, slow)), "3 more outer steps")
    recent = {m.id: [r for r in _outer(m) if r["world"] == 3 and r["step"] > first + 1
                     and r["live"]] for m in (a, b, slow)}  # fmt: skip
    slow_samples = [r["samples"] for r in recent["s"]]
    fast_samples = [r["samples"] for m in ("a", "b") for r in recent[m]]
    assert statistics.median(fast_samples) >= 3 * statistics.median(slow_samples), (
        fast_samples, slow_samples)  # fmt: skip
    waits = [r["sync_s"] for m in ("a", "b") for r in recent[m]]
    assert statistics.median(waits) < 6.0, waits  # far under an even share's 18 s
    assert assert_equal_from([a, b, slow], first) >= 3


def _check_weighted_mean(dumps: Path, ids: list[str]) -> int:
    """For every outer step all of ``ids`` dumped with three members: they held the same global
    parameters before and after, and after is ``sum(n_i * local_i) / sum(n_i)``."""
    by_step: dict[int, dict[str, dict[str, Any]]] = {}
    for path in dumps.glob("*.pt"):
        node, step = path.stem.rsplit("-", 1)
        by_step.setdefault(int(step), {})[node] = torch.load(path)
    checked = 0
    for step, d in sorted(by_step.items()):
        if set(d) != set(ids) or any(x["world"] != 3 for x in d.values()):
            continue
        ref = d[ids[0]]
        for other in ids[1:]:
            for key in ("before", "after"):
                for p, q in zip(ref[key], d[other][key], strict=True):
                    assert torch.equal(p, q), f"{key} differs at outer step {step}"
        total = sum(int(d[i]["samples"]) for i in ids)
        samples = {int(d[i]["samples"]) for i in ids}
        assert len(samples) > 1, "the members' samples were equal: weighting is not tested"
        for k, got in enumerate(ref["after"]):
            want = sum(d[i]["local"][k] * int(d[i]["samples"]) for i in ids) / total
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            plain = sum(d[i]["local"][k] for i in ids) / len(ids)
            assert not torch.allclose(got, plain, rtol=1e-4, atol=1e-6) or k > 0
        checked += 1
    return checked


def test_with_overlap_members_compute_beside_the_outer_step_and_stay_equal(
    cluster: Cluster,
) -> None:
    """``overlap=True``: the outer step runs on a background thread while the next inner
    phase computes. b is slower (0.08 s per inner step against a's 0.02 s), so a's outer step
    waits for b in the background, and a's next inner steps run beside it. A founder trains
    alone, b joins, c joins and is killed in an outer allreduce, b leaves; the global
    parameters and the outer momentum (digested on the background thread right after each
    outer optimizer step) stay bitwise equal at every common outer step, and the audit never
    finds a member different."""
    inner = ("--inner-steps", "6", "--overlap")
    a = cluster.start("a", None, *inner, "--inner-sleep", "0.02")
    cluster.wait(lambda: a.last().get("step", 0) >= 3, "a to take outer steps alone")
    b = cluster.start("b", a, *inner, "--inner-sleep", "0.08")
    cluster.wait(lambda: world(a, 2) and world(b, 2), "b to join a")
    c = cluster.start("c", a, *inner, "--inner-sleep", "0.02", "--die-after", "4")
    cluster.wait(lambda: c.proc.poll() is not None, "c to join, train and die mid-allreduce")
    assert c.proc.returncode == 70, c.log()
    died = max(c.digests())
    cluster.wait(lambda: world(a, 2, died + 4) and world(b, 2, died + 4), "a and b go on")
    b.leave()
    cluster.wait(lambda: any(r.get("left") for r in b.records()), "b to leave")
    left = max(b.digests())
    cluster.wait(lambda: world(a, 1, left + 2), "a to go on alone")
    assert any(r["world"] == 3 for r in _outer(a)), "c never took part in an outer step"
    assert assert_equal_from([a, b], min(b.digests())) >= 8
    assert assert_equal_from([a, c], min(c.digests())) >= 2
    assert len({r["digest"] for r in _outer(a)}) == len(_outer(a))
    # a's inner steps ran while its outer step waited for b in the background
    boundaries = [r for r in a.records() if r.get("boundary") and r["world"] == 2]
    assert len(boundaries) >= 5
    assert statistics.median(r["overlapped"] for r in boundaries) >= 3, boundaries
    for m in (a, b, c):
        assert all(r["mismatches"] == 0 for r in _outer(m)), m.id
    assert _outer(a)[-1]["audits"] >= 1
