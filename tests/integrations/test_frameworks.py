"""The frameworks on an elastic cluster, with real processes: Hugging Face
``transformers.Trainer`` (``hf_worker.py``: a tiny GPT-2 from a config) and Lightning
(``lightning_worker.py``: a small LightningModule), each with AdamW, a warmup schedule, gradient
accumulation and clipping as its users set them. Three devices, a late joiner, and a ``kill -9``
of a member: the survivors end bitwise equal, every device's ``global_step`` is the cluster's
step, and all stop at ``max_steps`` together."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.trainer.trainer_cluster import Cluster, Member, assert_equal_from, world

HF_WORKER = Path(__file__).with_name("hf_worker.py")
LIGHTNING_WORKER = Path(__file__).with_name("lightning_worker.py")
MAX_STEPS = 700
STEPS_PER_EPOCH = {HF_WORKER: 512, LIGHTNING_WORKER: 256}
"""Optimizer steps per epoch of each worker's shard: 4096 rows, 4 or 8 a batch, 2 batches a
step."""


@pytest.fixture(params=[HF_WORKER, LIGHTNING_WORKER], ids=["huggingface", "lightning"])
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    with contextlib.closing(Cluster(tmp_path, request.param)) as c:  # reaped even on failure
        yield c


def _steps(m: Member) -> list[dict]:
    return [r for r in m.records() if "digest" in r and not r.get("done")]


def _done(m: Member) -> dict:
    return next((r for r in m.records() if r.get("done")), {})


def _epoch_starts(m: Member) -> list[int]:
    """The cluster's step at each start of ``m``'s loader epoch."""
    return [r["step"] for r in m.records() if r.get("epoch_begin")]


def test_a_framework_survives_a_late_join_and_a_kill(cluster: Cluster) -> None:
    run = ("--max-steps", str(MAX_STEPS))
    a = cluster.start("a", None, *run)
    cluster.wait(lambda: a.last().get("step", 0) >= 5, "a to train")
    b = cluster.start("b", a, *run)
    cluster.wait(lambda: world(a, 2) and world(b, 2), "b to join a")
    c = cluster.start("c", a, *run)
    cluster.wait(lambda: world(a, 3) and world(b, 3) and world(c, 3), "c to join a and b")
    three = max(r["step"] for r in _steps(c))
    cluster.wait(lambda: a.last()["step"] >= three + 10, "10 steps of three members")
    assert a.last()["step"] < MAX_STEPS - 50, "the joins took too long to leave steps for the kill"
    os.killpg(b.proc.pid, signal.SIGKILL)  # kill -9 of b and its embedded daemon
    b.proc.wait(timeout=30)
    cluster.members.pop("b")  # reaped: no longer watched for an unexpected exit
    killed_at = a.last()["step"]
    cluster.wait(lambda: _done(a) and _done(c), "the survivors to reach max_steps")
    for m in (a, c):
        assert m.proc.wait(timeout=60) == 0, m.log()
    # every device's global_step is the cluster's step, from the joiner's first step on
    for m in (a, b, c):
        recs = _steps(m)
        assert recs, f"{m.id} recorded no step"
        assert all(r["global_step"] == r["step"] for r in recs), m.id
    # the late joiner entered mid-run: its first step moved it to the cluster's step
    first_c = _steps(c)[0]
    assert first_c["step"] > 20 and first_c["global_step"] == first_c["step"]
    assert any(r["world"] == 3 for r in _steps(a)), "c never took part in a step"
    # all stopped together at max_steps, bitwise equal
    done_a, done_c = _done(a), _done(c)
    assert done_a["step"] == done_c["step"] == MAX_STEPS
    assert done_a["global_step"] == done_c["global_step"] == MAX_STEPS
    assert done_a["digest"] == done_c["digest"]
    assert assert_equal_from([a, b, c], first_c["step"]) >= 10
    assert assert_equal_from([a, c], killed_at) >= 50
    # the schedule and the averaged gradient's clipping ran on every member alike
    by_step = {r["step"]: r for r in _steps(a)}
    for r in _steps(c):
        ref = by_step[r["step"]]
        assert r["lr"] == ref["lr"], r["step"]
        if r["live"]:  # a joiner's entry step dropped its gradients: it clipped nothing
            assert r["grad_norm"] == ref["grad_norm"], r["step"]
    assert len({r["lr"] for r in _steps(a)}) > 100
    # the loaders' epochs end where the cluster's do: the late joiner's first one too, which
    # began mid-epoch (its loader at its shard's beginning), not a full pass later
    spe = STEPS_PER_EPOCH[cluster.worker]
    bounds = list(range(spe, MAX_STEPS, spe))
    assert _epoch_starts(a) == [0, *bounds]
    joined = _epoch_starts(c)[0]
    later = [b for b in bounds if b > joined]
    assert joined > 0 and later and _epoch_starts(c)[1:] == later, _epoch_starts(c)
