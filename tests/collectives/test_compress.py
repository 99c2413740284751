"""The blockwise int8 format and its error feedback (:mod:`chaos.collectives.compress`)."""

from __future__ import annotations

import math

import pytest
import torch

from chaos.collectives.compress import (
    BLOCK,
    NAN_CODE,
    ErrorFeedback,
    blocks,
    decode,
    encode,
    payload_bytes,
)


def _rand(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("n", [1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 13])
def test_round_trip_error_is_within_half_a_step_of_each_block(n: int) -> None:
    x = _rand(n, n, scale=3.0)
    x[0] = 1e4  # one large value: its block's step is large, the others' are not
    payload = encode(x)
    assert payload.numel() == payload_bytes(n) == 4 * blocks(n) + n
    y = decode(payload, n)
    for k in range(blocks(n)):
        blk = slice(k * BLOCK, min(n, (k + 1) * BLOCK))
        step = float(x[blk].abs().max()) / 127
        assert float((x[blk] - y[blk]).abs().max()) <= step / 2 * (1 + 1e-5)
    # the block's largest magnitude round-trips to itself (within float32 rounding)
    assert math.isclose(float(y[0]), 1e4, rel_tol=1e-6)


def test_same_input_same_bytes_and_round_half_even() -> None:
    x = _rand(10 * BLOCK + 3, 1)
    a, b = encode(x), encode(x.clone())
    assert torch.equal(a, b)
    # halves round to even: with amax 127 the scale is 1, so the codes are round(x)
    half = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5])
    codes = encode(half)[4:].view(torch.int8).tolist()
    assert codes == [127, 0, 2, 2, 0, -2, -2]


def test_zeros_and_tiny_blocks_decode_to_zero() -> None:
    for x in (torch.zeros(300), torch.full((300,), 1e-44), torch.tensor([-0.0])):
        y = decode(encode(x), x.numel())
        assert torch.equal(y.abs(), torch.zeros(x.numel()))
        assert torch.isfinite(y).all()
    assert encode(torch.zeros(0)).numel() == 0
    assert decode(torch.zeros(0, dtype=torch.uint8), 0).numel() == 0


def test_non_finite_values_stay_non_finite_at_their_position() -> None:
    x = _rand(3 * BLOCK, 2)
    bad = [5, BLOCK + 1, 2 * BLOCK + 7]
    x[bad[0]], x[bad[1]], x[bad[2]] = float("nan"), float("inf"), float("-inf")
    payload = encode(x)
    codes = payload[4 * blocks(x.numel()) :].view(torch.int8)
    assert sorted((codes == NAN_CODE).nonzero().flatten().tolist()) == bad
    y = decode(payload, x.numel())
    assert sorted(torch.isnan(y).nonzero().flatten().tolist()) == bad
    ok = torch.isfinite(x)
    # the rest of each block keeps its finite scale
    assert float((x[ok] - y[ok]).abs().max()) <= float(x[ok].abs().max()) / 127


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError):
        encode(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError):
        encode(torch.zeros(4), out=torch.empty(3, dtype=torch.uint8))
    with pytest.raises(ValueError):
        decode(torch.zeros(7, dtype=torch.uint8), 4)


def _send(x: torch.Tensor, fb: ErrorFeedback) -> torch.Tensor:
    """What one member sends with error feedback (as the int8 round does at its first send)."""
    r = fb.residual(x.numel())
    exact = x if r is None else x + r
    fb.pending(x.numel())
    sent = decode(encode(exact), x.numel())
    fb.wrote(0, x.numel(), exact - sent)
    assert fb.commit()
    return sent


def test_error_feedback_keeps_the_running_sum_on_track() -> None:
    n, rounds = 4 * BLOCK, 200
    fb = ErrorFeedback()
    total_in = torch.zeros(n, dtype=torch.float64)
    total_sent = torch.zeros(n, dtype=torch.float64)
    total_plain = torch.zeros(n, dtype=torch.float64)
    for t in range(rounds):
        # a small steady signal under noise of larger magnitude: plain rounding loses it
        x = _rand(n, 100 + t) + 0.003
        total_in += x.double()
        total_sent += _send(x, fb).double()
        total_plain += decode(encode(x), n).double()
    drift = float((total_in - total_sent).abs().max())
    plain = float((total_in - total_plain).abs().max())
    # the drift is the last residual: at most half a step (a block of N(0,1): amax < 6)
    assert drift <= 6 / 127 / 2 * 1.01
    assert drift == pytest.approx(float(fb.residual(n).abs().max()), rel=1e-4)  # type: ignore[union-attr]
    assert plain > 5 * drift  # without feedback the error grows with the rounds


def test_error_feedback_commit_discard_and_non_finite() -> None:
    fb = ErrorFeedback()
    assert fb.residual(4) is None and fb.norm == 0.0
    fb.pending(4)
    fb.wrote(0, 2, torch.tensor([0.5, float("nan")]))
    assert not fb.commit()  # half written: not taken
    assert fb.residual(4) is None
    fb.pending(4)
    fb.wrote(0, 4, torch.tensor([0.5, float("nan"), float("inf"), -0.25]))
    fb.discard()  # a failed round
    assert fb.residual(4) is None
    fb.pending(4)
    fb.wrote(0, 4, torch.tensor([0.5, float("nan"), float("inf"), -0.25]))
    assert fb.commit()
    r = fb.residual(4)
    assert r is not None and r.tolist() == [0.5, 0.0, 0.0, -0.25]
    assert fb.residual(5) is None  # another size starts from zero
