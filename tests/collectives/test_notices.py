"""The pure parts of a communicator's out-of-round handling (chaos.collectives.notices) and of
its topology: which early frames a round takes, keeps or drops, and who sends data to whom.

The notices on real sockets are covered by tests/collectives/test_collectives.py (split epochs,
catch-up).
"""

from __future__ import annotations

import pytest
import torch

from chaos.collectives.frames import Header, Op
from chaos.collectives.links import Frame
from chaos.collectives.notices import sort_early
from chaos.collectives.topology import Topology


def _frame(peer: str, op: Op, epoch: int, step: int) -> Frame:
    header = Header(op, torch.float32, 0, epoch, step, 0, 0)
    return Frame(peer, header, b"", b"")  # type: ignore[arg-type]


def test_a_round_takes_its_own_frames_in_order_and_keeps_later_ones() -> None:
    mine1 = _frame("a", Op.TREE_UP, 5, 10)
    mine2 = _frame("b", Op.TREE_UP, 5, 10)
    next_step = _frame("a", Op.TREE_UP, 5, 11)
    later_notice = _frame("c", Op.NEWER, 6, 11)
    out = sort_early([mine1, next_step, later_notice, mine2], (5, 10))
    assert list(out.ready) == [mine1, mine2]
    assert list(out.later) == [next_step, later_notice]
    assert out.newer_epoch is None
    assert out.stale == 0 and out.stale_peers == []


def test_older_frames_are_dropped_and_their_senders_of_this_step_named() -> None:
    same_step_old_epoch = _frame("a", Op.TREE_UP, 4, 10)
    old_step = _frame("b", Op.TREE_UP, 5, 9)
    out = sort_early([same_step_old_epoch, old_step], (5, 10))
    assert not out.ready and not out.later
    assert out.stale == 2
    assert out.stale_peers == ["a"]  # only a peer in this step can be told of the newer epoch


def test_this_step_under_a_newer_epoch_means_the_round_cannot_complete() -> None:
    newer_data = _frame("a", Op.TREE_UP, 7, 10)
    newer_notice = _frame("b", Op.NEWER, 8, 10)
    stale_notice = _frame("c", Op.NEWER, 4, 10)
    out = sort_early([newer_data, newer_notice, stale_notice], (5, 10))
    assert out.newer_epoch == 8
    assert list(out.later) == [newer_data]  # kept for the newer round; notices are applied
    assert out.stale == 0


def test_senders_of_a_ring_and_a_tree() -> None:
    addresses = {n: f"tcp://127.0.0.1:{5000 + i}" for i, n in enumerate("abcd")}
    ring = Topology("ring", tuple("abcd"), addresses, 1, ring_order=("a", "b", "c", "d"))
    assert ring.senders("a") == ["d"]
    assert ring.senders("c") == ["b"]
    tree = Topology("tree", tuple("abcd"), addresses, 1, parent={"a": None, "b": "a", "c": "a",
                                                                 "d": "b"})  # fmt: skip
    assert tree.senders("a") == ["b", "c"]  # the root: its children reduce to it
    assert tree.senders("b") == ["d", "a"]  # children up, the parent down
    assert tree.senders("d") == ["b"]
    with pytest.raises(ValueError):
        ring.senders("z")


def _result(nelem: int, values: torch.Tensor) -> Frame:
    from types import SimpleNamespace

    header = Header(Op.RESULT, torch.float32, 0, 1, 7, 0, nelem)
    payload = SimpleNamespace(buffer=values.numpy().tobytes())
    return Frame("n1", header, b"", payload)  # type: ignore[arg-type]


def test_a_kept_result_must_match_the_call_unless_its_tail_is_free() -> None:
    """A neighbour's kept result of the step: of the call's length, it is taken as it is. One
    kept under another membership has an audit tail of another length: without ``free_tail``
    it fails the round; with it, its first values are taken and the call's tail is zero. One
    too short for the part that must match fails either way."""
    from chaos.collectives.links import result_of
    from chaos.errors import ProtocolError

    mine = torch.zeros(10)  # 6 values that must match, then a tail of 4
    same = torch.arange(10, dtype=torch.float32)
    assert torch.equal(result_of(_result(10, same), mine, free_tail=4), same)
    longer = torch.arange(13, dtype=torch.float32)  # the same 6, then a tail of 7
    with pytest.raises(ProtocolError, match="does not match this round"):
        result_of(_result(13, longer), mine)
    got = result_of(_result(13, longer), mine, free_tail=4)
    assert torch.equal(got, torch.tensor([0, 1, 2, 3, 4, 5, 0, 0, 0, 0], dtype=torch.float32))
    shorter = torch.arange(8, dtype=torch.float32)  # the same 6, then a tail of 2
    assert torch.equal(result_of(_result(8, shorter), mine, free_tail=4)[:6], shorter[:6])
    with pytest.raises(ProtocolError, match="does not match this round"):
        result_of(_result(5, torch.arange(5, dtype=torch.float32)), mine, free_tail=4)
