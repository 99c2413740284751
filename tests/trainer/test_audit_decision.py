"""The state audit's pure parts: who is the odd one out, and the digest slots' round trip."""

from __future__ import annotations

import pytest
import torch

from chaos.trainer.audit import SLOT, StateAudit, decode_slots, encode_slots, odd_ones

A, B = b"\x01" * SLOT, b"\x02" * SLOT


def test_the_minority_is_odd() -> None:
    assert odd_ones({"a": A, "b": A, "c": B}) == (A, ["c"])
    assert odd_ones({"a": B, "b": A, "c": A, "d": A}) == (A, ["a"])


def test_agreement_names_nobody() -> None:
    assert odd_ones({"a": A, "b": A}) == (A, [])


def test_no_majority_goes_to_the_lowest_id() -> None:
    assert odd_ones({"b": B, "a": A}) == (A, ["b"])
    assert odd_ones({"z": A, "m": B, "c": b"\x03" * SLOT}) == (b"\x03" * SLOT, ["m", "z"])
    # the largest group wins even when the lowest id is outside it
    assert odd_ones({"a": A, "b": B, "c": B, "d": A, "e": B}) == (B, ["a", "d"])


def test_members_without_a_digest_are_left_out() -> None:
    assert odd_ones({"a": None, "b": A, "c": A}) == (A, [])
    assert odd_ones({"a": None}) == (None, [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_slots_sum_to_every_digest(dtype: torch.dtype) -> None:
    members = ["a", "b", "c"]
    digests = [bytes([0, 255, 7, 128, 1, 2, 3, 4]), A, B]
    total = sum(encode_slots(d, i, 3, dtype) for i, d in enumerate(digests))
    assert isinstance(total, torch.Tensor)
    assert decode_slots(total, members) == dict(zip(members, digests, strict=True))


def test_a_slot_that_is_not_one_digest_reads_as_none() -> None:
    ff = b"\xff" * SLOT
    tail = encode_slots(ff, 0, 2, torch.float32) * 2  # two members wrote the same slot
    assert decode_slots(tail, ["a", "b"]) == {"a": None, "b": None}  # b's slot is empty


def test_fold_and_unfold_find_the_odd_member() -> None:
    audits = {n: StateAudit(n, 5, lambda step, n=n: (B if n == "c" else A) + b"rest")
              for n in ("a", "b", "c")}  # fmt: skip
    grads = torch.arange(4, dtype=torch.float32)
    folded = [audits[n].fold(grads, 10, ["c", "a", "b"]) for n in audits]
    total = sum(folded[1:], folded[0])
    for n, audit in audits.items():
        assert torch.equal(audit.unfold(total), 3 * grads)
        assert audit.last is not None and audit.last.odd == ("c",)
        assert (audit.to_heal is not None) == (n == "c")
    assert audits["a"].fold(grads, 11, ["a", "b"]) is grads  # not an audited step
    assert audits["a"].fold(grads, 10, ["a"]) is grads  # nobody to compare with


def test_a_flipped_bit_changes_one_element_by_one_bit() -> None:
    p = torch.zeros(6)
    audit = StateAudit("a", 5, lambda step: A)
    audit.flip_bit_at(3, param=0, element=2, bit=31)
    assert not audit.maybe_flip(2, [p])
    assert audit.maybe_flip(3, [p])
    assert p.view(torch.int32).tolist() == [0, 0, -(1 << 31), 0, 0, 0]
    with pytest.raises(ValueError):
        audit.flip_bit_at(-1, 0, 0, 0)
