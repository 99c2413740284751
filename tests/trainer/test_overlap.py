"""The pure parts of the overlapped outer step: a phase's progress, the rebase, and the thread
that runs one outer step at a time."""

from __future__ import annotations

import threading

import pytest
import torch

from chaos.errors import ConfigError
from chaos.trainer import LocalStepsConfig
from chaos.trainer.overlap import BackgroundSync, SyncTimeout, progress, rebase


def test_progress_is_anchor_minus_local_and_rebase_adds_it_to_the_new_global() -> None:
    anchor = [torch.tensor([1.0, 2.0]), torch.tensor([[3.0]])]
    local = [torch.tensor([0.5, 2.5]), torch.tensor([[1.0]])]
    delta = progress(anchor, local)
    assert torch.equal(delta[0], torch.tensor([0.5, -0.5]))
    assert torch.equal(delta[1], torch.tensor([[2.0]]))
    new_global = [torch.tensor([10.0, 20.0]), torch.tensor([[30.0]])]
    rebase(local, new_global, delta)
    assert torch.equal(local[0], torch.tensor([9.5, 20.5]))  # the new global plus the progress
    assert torch.equal(local[1], torch.tensor([[28.0]]))


def test_a_delayed_outer_step_applies_each_phase_once() -> None:
    """Two members, plain outer SGD with lr 1 (the outer step adds the mean pseudo-gradient):
    each phase's outer step ends during the next phase, and each member rebases on it. Once
    the last outer step has ended, the global parameters have moved by exactly the mean of the
    members' inner updates over all phases (none lost, none counted twice), and after every
    rebase each member's model is the global parameters plus its own last phase's updates."""
    torch.manual_seed(0)
    g = torch.zeros(4)
    models = [g.clone(), g.clone()]
    anchors = [g.clone(), g.clone()]
    pending: torch.Tensor | None = None
    total = torch.zeros(4)
    for _phase in range(5):
        phase_updates = [torch.zeros(4), torch.zeros(4)]
        for _inner in range(3):
            for m, u in zip(models, phase_updates, strict=True):
                step = torch.randn(4)
                m -= step
                u += step
        total += (phase_updates[0] + phase_updates[1]) / 2
        deltas = [progress([a], [m])[0] for a, m in zip(anchors, models, strict=True)]
        if pending is not None:
            g -= pending  # the previous phase's outer step has ended
        for m, d, u in zip(models, deltas, phase_updates, strict=True):
            rebase([m], [g], [d])
            assert torch.allclose(m, g - u, atol=1e-5)
        anchors = [m.clone() for m in models]
        pending = (deltas[0] + deltas[1]) / 2
    assert pending is not None
    g -= pending
    assert torch.allclose(g, -total, atol=1e-5)


def test_progress_and_rebase_refuse_mismatched_lists() -> None:
    with pytest.raises(ValueError, match="anchors"):
        progress([torch.zeros(1)], [])
    with pytest.raises(ValueError, match="shapes differ"):
        progress([torch.zeros(1)], [torch.zeros(2)])
    with pytest.raises(ValueError, match="deltas"):
        rebase([torch.zeros(1)], [torch.zeros(1)], [])


def test_background_sync_hands_back_the_result_or_the_error() -> None:
    sync = BackgroundSync(timeout_s=10.0)
    assert sync.wait() is None and not sync.pending
    sync.start(lambda: 42, "t")
    assert sync.pending
    assert sync.wait() == 42 and not sync.pending

    def fail() -> None:
        raise KeyError("boom")

    sync.start(fail, "t")
    with pytest.raises(KeyError, match="boom"):
        sync.wait()
    assert sync.wait() is None  # raised once


def test_background_sync_runs_one_step_at_a_time_and_its_wait_times_out() -> None:
    release = threading.Event()
    sync = BackgroundSync(timeout_s=0.2)
    sync.start(lambda: release.wait(10.0), "t")
    assert sync.running
    with pytest.raises(RuntimeError, match="still pending"):
        sync.start(lambda: None, "t")
    with pytest.raises(SyncTimeout, match="without ending"):
        sync.wait()
    release.set()
    assert sync.wait() is True


@pytest.mark.parametrize("bad", [{"overlap": 1}, {"sync_timeout_s": 0}, {"sync_timeout_s": True}])
def test_overlap_options_are_checked(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        LocalStepsConfig(**bad)  # type: ignore[arg-type]
