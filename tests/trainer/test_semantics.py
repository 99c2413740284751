"""Training semantics with real processes: sample-weighted averaging, gradient accumulation,
the step hooks and ``extra_state`` across joins and kills.

Each worker (``semantics_worker.py``) is a real member with its embedded daemon on loopback; it
appends one JSON line per step with a digest of its state. Tests wait for conditions with
generous deadlines, never assert timing, and kill and reap every process group at the end.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer.trainer_cluster import (
    SEMANTICS_WORKER,
    Cluster,
    Member,
    assert_equal_from,
    world,
)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with contextlib.closing(Cluster(tmp_path, SEMANTICS_WORKER)) as c:  # reaped even on failure
        yield c


# ----------------------------------------------------------------------------- helpers


def _reference_grads(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> list[Any]:
    """The gradient of the mean loss over the batch ``(x, y)`` in one process."""
    sys.path.insert(0, str(SEMANTICS_WORKER.parent))
    try:
        from semantics_worker import build_model  # noqa: PLC0415 - the worker's own model
    finally:
        sys.path.pop(0)
    model = build_model()
    with torch.no_grad():
        for p, v in zip(model.parameters(), params, strict=True):
            p.copy_(v)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return [p.grad for p in model.parameters()]


def _dumps(tmp: Path, ids: list[str]) -> dict[int, dict[str, dict[str, Any]]]:
    """The dumps of the steps every member in ``ids`` dumped: step -> id -> dump."""
    by_step: dict[int, dict[str, dict[str, Any]]] = {}
    for path in (tmp / "dumps").glob("*.pt"):
        node, step = path.stem.rsplit("-", 1)
        by_step.setdefault(int(step), {})[node] = torch.load(path)
    return {s: d for s, d in by_step.items() if set(d) == set(ids)}


def _start_three(cluster: Cluster, batches: dict[str, int], *extra: str) -> list[Member]:
    ids = list(batches)
    members: list[Member] = []
    for i, node in enumerate(ids):
        join = members[0] if members else None
        m = cluster.start(node, join, "--batch", str(batches[node]), *extra)
        members.append(m)
        cluster.wait(lambda n=i + 1: all(world(x, n) for x in members), f"{node} to take part")
    return members


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("accum", [1, 3], ids=["one-pass", "accumulated"])
def test_sample_weighted_average_is_the_gradient_of_the_whole_batch(
    cluster: Cluster, tmp_path: Path, accum: int
) -> None:
    """With ``accum`` 3, each step's samples go through three backward passes (gradient
    accumulation) before one ``update()``."""
    batches = {"a": 3, "b": 8, "c": 21}
    dump = ["--dump-dir", str(tmp_path / "dumps"), "--dump-world", "3", "--dump-count", "3"]
    members = _start_three(cluster, batches, "--weighted", "--accum", str(accum), *dump)
    ids = list(batches)
    cluster.wait(lambda: len(_dumps(tmp_path, ids)) >= 2, "steps dumped by all three")
    checked = 0
    for step, dumps in sorted(_dumps(tmp_path, ids).items()):
        a, b, c = (dumps[i] for i in ids)
        for other in (b, c):  # the members held the same model and averaged to the same bits
            for p, q in zip(a["params"], other["params"], strict=True):
                assert torch.equal(p, q), f"parameters differ at step {step}"
            for p, q in zip(a["grads"], other["grads"], strict=True):
                assert torch.equal(p, q), f"averaged gradients differ at step {step}"
        x = torch.cat([dumps[i]["x"] for i in ids])
        y = torch.cat([dumps[i]["y"] for i in ids])
        assert x.shape[0] == sum(batches.values())
        for got, want in zip(a["grads"], _reference_grads(a["params"], x, y), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        # the mean of the members' means is a different gradient: the weighting mattered
        per_member = [_reference_grads(a["params"], dumps[i]["x"], dumps[i]["y"]) for i in ids]
        mean_of_means = [sum(gs) / 3 for gs in zip(*per_member, strict=True)]
        assert any(not torch.allclose(g, m, rtol=1e-4, atol=1e-6)
                   for g, m in zip(a["grads"], mean_of_means, strict=True))  # fmt: skip
        checked += 1
    assert checked >= 2
    first = max(m.last()["step"] for m in members)
    cluster.wait(lambda: all(m.last()["step"] > first + 5 for m in members), "5 more steps")
    assert assert_equal_from(members, first) >= 5


def test_hooks_and_extra_state_survive_a_late_join_and_a_kill(cluster: Cluster) -> None:
    """An LR scheduler, a GradScaler and an EMA in ``extra_state``, the averaged gradient
    unscaled and clipped in ``before_step``, ``scaler.step`` as ``step_fn``: a late joiner
    pulls them with the model and the members stay bitwise equal (the digest covers the
    extra states and the learning rate), through the joiner's kill too."""
    extras = ("--extras", "--weighted")
    a = cluster.start("a", None, "--batch", "6", *extras)
    cluster.wait(lambda: a.last().get("step", 0) >= 5, "a to train")
    b = cluster.start("b", a, "--batch", "10", *extras)
    cluster.wait(lambda: world(a, 2) and world(b, 2), "b to join a")
    before = a.last()["step"]
    c = cluster.start("c", b, "--batch", "4", "--die-after", "15", *extras)
    cluster.wait(lambda: c.proc.poll() is not None, "c to join, train and die mid-allreduce")
    assert c.proc.returncode == 70, c.log()
    first_c, died = min(c.digests()), max(c.digests())
    assert first_c > before, "the joiner took part only after the others had trained"
    assert any(r.get("world") == 3 for r in a.records()), "c never took part in a step"
    assert assert_equal_from([a, b, c], first_c) >= 10
    cluster.wait(lambda: world(a, 2, died + 10) and world(b, 2, died + 10), "survivors go on")
    assert assert_equal_from([a, b], before) >= 20
    # the extra state really changed along the way: warmup, cosine, scaler growth
    recs = [r for r in a.records() if "lr" in r]
    assert len({r["lr"] for r in recs}) > 10
    assert len({r["scale"] for r in recs}) > 3
    by_step = {r["step"]: r for r in recs}
    for r in c.records():
        if "lr" in r and r["step"] in by_step:
            assert (r["lr"], r["scale"]) == (by_step[r["step"]]["lr"], by_step[r["step"]]["scale"])
