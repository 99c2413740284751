"""The bounds on frames kept for a later round: bytes in all, and epochs ahead.

Real communicators on loopback, one thread each; the sender of the forged frames is a DEALER of
this test (:class:`~chaos.bench.forged_frames.KeyHolderSocket`): plain for communicators without
a key (the frames reach the inbox), with the cluster key and a keypair of its own for keyed
ones (its frames of a later epoch wait at the data endpoint for that epoch's keys).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from chaos.bench.forged_frames import KeyHolderSocket, data_frame
from chaos.collectives import Communicator, CommunicatorConfig, Topology
from chaos.collectives.config import DEFAULT_MAX_EARLY_BYTES
from chaos.collectives.frames import HEADER_BYTES
from chaos.errors import ConfigError, RoundInterrupted
from chaos.security import ClusterKey, Security
from chaos.trainer.config import TrainerConfig
from chaos.trainer.wiring import early_bytes_bound
from tests.collectives.test_secure_collectives import ROUNDS, inputs, install, members, results

PAYLOAD = 16 << 10  # bytes of each forged frame's payload
FRAME = PAYLOAD + HEADER_BYTES  # what a kept frame holds in the inbox


def rounds_until(comms: list[Communicator], xs: list[torch.Tensor], done: Any) -> None:
    """Runs rounds (each reads what came meanwhile) until ``done()``; every result is checked."""
    for _ in range(ROUNDS):
        out = results(comms, xs, op="sum")
        torch.testing.assert_close(out[0], torch.stack(xs).sum(0), atol=1e-4, rtol=1e-5)
        if done():
            return
    raise AssertionError(f"not done after {ROUNDS} rounds: {comms[0].stats}")


def test_frames_far_ahead_are_dropped_and_those_up_to_the_bound_kept() -> None:
    xs = inputs(2)
    with members(2, None) as comms:
        install(comms, "ring", 1, keyed=False)
        results(comms, xs, op="sum")
        target = comms[0]
        stats = target.stats
        step = target._driver._last_key[1] + 1000  # a step these rounds never reach
        with KeyHolderSocket(target.address, None, claim="m1") as forger:
            # one and 64 epochs ahead are kept; 65 ahead and 10**9 are dropped
            for epoch in (2, 1 + 64, 1 + 65, 10**9):
                forger.send(data_frame(epoch, step, PAYLOAD))
            rounds_until(comms, xs, lambda: stats.early_buffered + stats.dropped_early_far >= 4)
        assert stats.dropped_early_far == 2 and stats.early_buffered == 2
        assert target.early_bytes == 2 * FRAME
        install(comms, "ring", 3, keyed=False)  # epoch 2's frame is stale now, 65's still kept
        assert target.early_bytes == FRAME and stats.dropped_early_far == 2
        results(comms, xs, op="sum")
        install(comms, "ring", 66, keyed=False)
        assert target.early_bytes == 0


def test_frames_kept_for_later_rounds_are_bounded_in_bytes() -> None:
    xs = inputs(2)
    cap = 3 * FRAME + 100  # three frames fit, a fourth does not
    with members(2, None, max_early_bytes=cap) as comms:
        install(comms, "ring", 1, keyed=False)
        results(comms, xs, op="sum")
        target = comms[0]
        stats = target.stats
        step = target._driver._last_key[1] + 1000
        with KeyHolderSocket(target.address, None, claim="m1") as forger:
            for i in range(10):
                forger.send(data_frame(2, step + i, PAYLOAD))
            rounds_until(comms, xs, lambda: stats.early_buffered + stats.dropped_early_bytes >= 10)
            assert stats.early_buffered == 3 and stats.dropped_early_bytes == 7
            assert target.early_bytes == 3 * FRAME <= cap
            install(comms, "ring", 3, keyed=False)  # they are stale now: the bytes come back
            assert target.early_bytes == 0
            forger.send(data_frame(4, step, PAYLOAD))
            rounds_until(comms, xs, lambda: stats.early_buffered == 4)
        assert target.early_bytes == FRAME and stats.dropped_early_bytes == 7


def test_a_key_holders_frames_held_for_a_later_epochs_keys_are_bounded() -> None:
    """A key holder that is no member sends frames of later epochs: the data endpoint holds
    them for those epochs' keys only within the bytes and epochs bounds; the next epoch's
    topology refutes those it held, and their bytes come back."""
    key = ClusterKey.generate()
    xs = inputs(2)
    with members(2, key, max_early_bytes=3 * (FRAME + 64)) as comms:
        install(comms, "ring", 1)
        results(comms, xs, op="sum")
        target = comms[0]
        stats, peers = target.stats, target._peers
        with KeyHolderSocket(target.address, Security(key), claim="m9") as forger:
            forger.send(data_frame(10**9, 1, PAYLOAD))
            for i in range(10):
                forger.send(data_frame(2, i, PAYLOAD))
            rounds_until(comms, xs, lambda: len(peers._held) + stats.dropped_early_bytes
                         + stats.dropped_early_far >= 11)  # fmt: skip
        assert len(peers._held) == 3 and stats.dropped_early_bytes == 7
        assert stats.dropped_early_far == 1
        held = sum(len(p) for *_, parts in peers._held for p in parts)
        assert target.early_bytes == held <= 3 * (FRAME + 64)
        install(comms, "ring", 2)  # its keys do not name the forger
        assert not peers._held and target.early_bytes == 0
        assert stats.dropped_unauthenticated == 3
        results(comms, xs, op="sum")


def test_a_member_two_epochs_ahead_has_its_frames_kept() -> None:
    """m1 rebuilt twice (epoch 3) and runs the step there while m0 still runs it under epoch 1:
    m0 keeps m1's frames, learns of the newer round and gives its own up; rerun under epoch 3,
    it completes with the frames it kept."""
    xs = inputs(2)
    with members(2, None) as comms:
        install(comms, "ring", 1, keyed=False)
        results(comms, xs, op="sum")
        m0, m1 = comms
        step = m0._driver._last_key[1] + 1
        names = ("m0", "m1")
        topo = Topology("ring", names, {c.node_id: c.address for c in comms}, 3, ring_order=names)
        m1.update_topology(topo)  # m1 alone moves on, two epochs ahead
        # gives up once it kept a frame of m1's (m1's NEWER notice may come first)
        m0.set_interrupt(lambda: "newer" if (m0.newer_round_seen() or 0) >= 3
                         and m0.stats.early_buffered >= 1 else None, 0.01)  # fmt: skip
        out: dict[str, Any] = {}

        def run(comm: Communicator) -> None:
            try:
                out[comm.node_id] = comm.allreduce(xs[int(comm.node_id[1])], "sum", step=step)
            except Exception as exc:  # checked below
                out[comm.node_id] = exc

        ahead = threading.Thread(target=run, args=(m1,))
        ahead.start()
        with pytest.raises(RoundInterrupted):
            m0.allreduce(xs[0], "sum", step=step)
        assert m0.stats.early_buffered >= 1 and m0.stats.dropped_early_far == 0
        m0.set_interrupt(None, 0.01)
        m0.update_topology(topo)
        run(m0)
        ahead.join(timeout=60)
        want = torch.stack(xs).sum(0)
        for name in ("m0", "m1"):
            assert isinstance(out[name], torch.Tensor), out
            torch.testing.assert_close(out[name], want, atol=1e-4, rtol=1e-5)
        assert torch.equal(out["m0"], out["m1"])


def test_the_bounds_are_checked_and_a_trainer_defaults_to_four_gradients() -> None:
    for bad in ({"max_early_bytes": -1}, {"max_early_bytes": True}, {"max_early_epochs": 0},
                {"max_early_epochs": 2.5}):  # fmt: skip
        with pytest.raises(ValueError, match="max_early"):
            CommunicatorConfig("n", **bad)
    with pytest.raises(ConfigError, match="max_early_bytes"):
        TrainerConfig(max_early_bytes=-5)
    assert CommunicatorConfig("n").max_early_bytes == DEFAULT_MAX_EARLY_BYTES == 256 << 20
    assert early_bytes_bound(TrainerConfig(), 1 << 20) == DEFAULT_MAX_EARLY_BYTES
    assert early_bytes_bound(TrainerConfig(), 1 << 30) == 4 << 30
    assert early_bytes_bound(TrainerConfig(max_early_bytes=1 << 20), 1 << 30) == 1 << 20
