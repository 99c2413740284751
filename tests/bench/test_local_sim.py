"""``chaos-bench local-sim``: the training arithmetic of the modes, in one process."""

from __future__ import annotations

import pytest
import torch

from chaos.bench.local_sim import SimConfig, simulate
from chaos.errors import ConfigError


def test_one_member_with_one_inner_step_is_the_plain_loop() -> None:
    """One member, H = 1, outer SGD lr 1 without momentum: each outer step sets the global
    parameters to the member's, so the held-out loss is the plain AdamW loop's, step by step
    (the same data, the same initial model)."""
    from chaos.emulate.train_models import (
        MODELS,
        Batches,
        build_model,
        eval_batch,
        load_data,
        loss_of,
    )

    cfg = SimConfig(members=1, inner_steps=1, samples=160, eval_every=80)
    curve = simulate(cfg)
    spec = MODELS["gpt"]
    data = load_data("gpt")
    model = build_model("gpt", data.vocab, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    batches = Batches("gpt", data, spec.batch, 0, 0)
    ex, ey = eval_batch("gpt", data, spec.eval_samples)
    plain = []
    for s in range(1, 160 // spec.batch + 1):
        x, y = batches.next()
        opt.zero_grad()
        loss_of("gpt", model, x, y).backward()
        opt.step()
        if s * spec.batch % 80 == 0:
            with torch.no_grad():
                plain.append((s * spec.batch, loss_of("gpt", model, ex, ey).item()))
    assert [s for s, _ in curve] == [s for s, _ in plain]
    for (_, a), (_, b) in zip(curve, plain, strict=True):
        assert a == pytest.approx(b, rel=1e-5)


def test_two_members_learn_and_the_delay_changes_the_path() -> None:
    base = simulate(SimConfig(members=2, inner_steps=2, samples=256, eval_every=128))
    late = simulate(SimConfig(members=2, inner_steps=2, samples=256, eval_every=128,
                              overlap=True))  # fmt: skip
    assert base[-1][1] < base[0][1] or base[-1][1] < 4.0  # it trains
    assert base[-1][1] != late[-1][1]


@pytest.mark.parametrize("bad", [{"members": 0}, {"outer_momentum": 1.0}, {"samples": 0}])
def test_bad_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        SimConfig(**bad)  # type: ignore[arg-type]
