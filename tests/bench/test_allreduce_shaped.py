"""The shaped-link case of ``chaos-bench allreduce`` (``--shaped``), run small: two members
in network namespaces behind tbf-shaped links to a hub, Chaos ring and tree beside gloo, one
repetition of a small tensor. Checks the JSON's figures are consistent (the bound from the
measured goodput, each ratio from its time) and that no namespace is left behind (the fixture
of ``test_emulate_network.py`` fails a test that leaves one). Nothing about speed is asserted:
the figures come from the benchmark, run in full.
"""

from __future__ import annotations

import math

import pytest

from chaos.bench.allreduce_shaped import SHAPED_ALGOS, ShapedConfig, bound_s, run_shaped
from tests.emulate.test_emulate_network import (
    PREFIX,
    _reap_namespaces,  # noqa: F401 - the autouse fixture that removes every namespace left
    needs_root,
)


def test_the_bound_is_the_ring_traffic_at_the_goodput() -> None:
    # two members: each sends the whole tensor once, both ways at once
    assert bound_s(2, 1_000_000, 8e6) == pytest.approx(1.0)
    # four: each sends 2 (n - 1) / n of it
    assert bound_s(4, 1_000_000, 8e6) == pytest.approx(1.5)


def test_the_config_refuses_bad_cases() -> None:
    with pytest.raises(ValueError, match="members"):
        ShapedConfig(members=(1,))
    with pytest.raises(ValueError, match="size"):
        ShapedConfig(size=6)
    with pytest.raises(ValueError, match="mbits"):
        ShapedConfig(mbits=())


@needs_root
def test_a_small_shaped_run_reports_consistent_figures() -> None:
    cfg = ShapedConfig(members=(2,), mbits=(50.0,), size=256 << 10, repeats=1, goodput_s=0.5,
                       prefix=PREFIX, timeout_s=120.0)  # fmt: skip
    result = run_shaped(cfg)
    (case,) = result["cases"]
    assert case["members"] == 2 and case["mbit"] == 50.0
    # tbf meters whole Ethernet frames: the TCP goodput is about 95% of the rate (a short
    # window on a loaded host reads somewhat high or low)
    assert 0.5 < case["goodput_of_rate"] < 1.3
    assert case["bound_s"] == pytest.approx(bound_s(2, cfg.size, case["goodput_bps"]))
    for algo in SHAPED_ALGOS:
        assert len(case["times_s"][algo]) == 1
        t = case[f"{algo}_s"]
        assert t > 0 and math.isfinite(t)
        assert case[f"{algo}_bound"] == pytest.approx(t / case["bound_s"])
    assert case["chaos_algo"] == "tree"
    assert case["chaos_vs_gloo"] == pytest.approx(case["gloo_s"] / case["tree_s"])
