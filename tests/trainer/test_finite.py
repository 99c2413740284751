"""The finiteness checks of the packed gradient buffer (``chaos.trainer.finite``), as pure
functions: the local check, the mark a bad contribution carries, and the verdict on a sum."""

from __future__ import annotations

import math

import pytest
import torch

from chaos.errors import ConfigError, NonFiniteGradient
from chaos.trainer.config import NonFiniteMode, TrainerConfig
from chaos.trainer.finite import FiniteGuard, check_local, mark_bad, reduced_verdict, slot

N = 1000


def _buf(values: torch.Tensor, weight: float = 4.0) -> torch.Tensor:
    return torch.cat([values * weight, torch.tensor([weight])])


def test_finite_gradients_pass_and_each_kind_of_bad_one_is_named() -> None:
    g = torch.randn(N)
    assert check_local(_buf(g), N, None) is None
    nan, inf, ninf = g.clone(), g.clone(), g.clone()
    nan[7], inf[5], ninf[900] = math.nan, math.inf, -math.inf
    assert check_local(_buf(nan), N, None) == "nan"
    assert check_local(_buf(inf), N, None) == "inf"
    assert check_local(_buf(ninf), N, 10.0) == "inf"


def test_the_norm_bound_counts_the_unweighted_gradient() -> None:
    g = torch.full((N,), 1.0)  # norm sqrt(1000) ~ 31.6, weighted by 4 in the buffer
    assert check_local(_buf(g), N, 40.0) is None  # the weighted norm (126) would fail
    reason = check_local(_buf(g), N, 30.0)
    assert reason is not None and reason.startswith("norm")
    huge = _buf(g * 1e30)  # finite, but its squares overflow float32
    assert bool(torch.isfinite(huge).all())
    assert check_local(huge, N, 1e6) is not None
    assert check_local(huge, N, None) is None  # finiteness alone lets it through


def test_a_sum_of_large_finite_elements_is_not_taken_for_a_bad_one() -> None:
    g = torch.full((N,), 3e38)  # the sum overflows, every element is finite
    buf = torch.cat([g, torch.tensor([1.0])])
    assert check_local(buf, N, None) is None
    assert reduced_verdict(buf, N, ["a", "b"]) is None


def test_a_marked_contribution_names_its_device_in_the_sum() -> None:
    ids = ["a", "b", "c"]
    bufs = {m: _buf(torch.randn(N)) for m in ids}
    mark_bad(bufs["b"], N, "b")
    assert float(bufs["b"][N]) == 4.0  # the weight is kept
    assert int(torch.isnan(bufs["b"]).sum()) == 1 and bool(torch.isnan(bufs["b"][slot("b", N)]))
    total = bufs["a"] + bufs["b"] + bufs["c"]
    verdict = reduced_verdict(total, N, ids)
    assert verdict is not None and verdict.devices == ("b",)
    mark_bad(bufs["c"], N, "c")
    both = reduced_verdict(bufs["a"] + bufs["b"] + bufs["c"], N, ids)
    assert both is not None and both.devices == ("b", "c")
    clean = {m: _buf(torch.randn(N)) for m in ids}
    assert reduced_verdict(sum(clean.values()), N, ids) is None  # type: ignore[arg-type]


def test_an_overflowed_sum_or_a_zero_weight_is_bad_without_a_device() -> None:
    over = torch.cat([torch.full((N,), math.inf), torch.tensor([3.0])])
    v = reduced_verdict(over, N, ["a"])
    assert v is not None and v.devices == ()
    zero = torch.zeros(N + 1)  # nobody contributed: the average would be 0/0
    v = reduced_verdict(zero, N, ["a"])
    assert v is not None


def test_the_slot_is_the_same_for_an_id_everywhere_and_within_range() -> None:
    assert slot("device-7", N) == slot("device-7", N)
    assert all(0 <= slot(f"n{i}", 5) < 5 for i in range(50))
    assert len({slot(f"n{i}", N) for i in range(20)}) > 15


def test_the_guard_marks_skips_counts_and_raises_by_mode() -> None:
    bad = _buf(torch.full((N,), math.nan))
    skip = FiniteGuard(NonFiniteMode.SKIP, None, N, "b")
    skip.outgoing(bad)
    assert skip.local_reason == "nan" and int(torch.isnan(bad).sum()) == 1
    verdict = skip.verdict(bad, ["a", "b"])
    assert verdict is not None and verdict.devices == ("b",)
    fields = skip.record(verdict, 12, 3)
    assert fields["action"] == "skipped" and skip.offences == {"b": 1} and skip.skipped == 1
    skip.raise_if(verdict, 12)  # skip mode: no error
    assert skip.skips(bad)
    raising = FiniteGuard(NonFiniteMode.RAISE, None, N, "a")
    with pytest.raises(NonFiniteGradient, match="step 12.*b") as exc:
        raising.raise_if(verdict, 12)
    assert exc.value.devices == ("b",) and exc.value.step == 12
    assert not raising.skips(bad)  # a raising cluster never logged a skipped step
    off = FiniteGuard(NonFiniteMode.OFF, None, N, "a")
    again = _buf(torch.full((N,), math.nan))
    off.outgoing(again)
    assert int(torch.isnan(again).sum()) == N and off.verdict(again, ["a"]) is None


def test_the_config_takes_a_mode_by_value_and_refuses_bad_ones() -> None:
    assert TrainerConfig().nonfinite is NonFiniteMode.SKIP
    assert TrainerConfig(nonfinite="raise").nonfinite is NonFiniteMode.RAISE
    assert TrainerConfig(nonfinite=NonFiniteMode.OFF, max_grad_norm=5).max_grad_norm == 5
    for bad in ({"nonfinite": "ignore"}, {"max_grad_norm": 0}, {"max_grad_norm": math.inf},
                {"max_grad_norm": True}, {"max_grad_norm": "1"}):  # fmt: skip
        with pytest.raises(ConfigError):
            TrainerConfig(**bad)  # type: ignore[arg-type]
