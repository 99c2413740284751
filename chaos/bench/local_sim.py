"""``chaos-bench local-sim``: what local steps cost per sample, without a network.

The arithmetic of the training modes, in one process, on the model and data of ``chaos-emulate
train`` (:mod:`chaos.emulate.train_models`): ``n`` members are plain copies of the model, each
with its own AdamW and its own batches. Every ``h`` inner steps the members' pseudo-gradients
(each member's progress since its phase began) are averaged and an outer SGD steps the global
parameters (lr ``outer_lr``, momentum ``outer_momentum``, Nesterov's when above 0); then every
member starts its next phase from them, or, with ``overlap``, from them plus its own last
phase's progress, the average applied one outer step late (what ``LocalSteps(overlap=True)``
computes). ``h = 1`` with ``n = 1`` is one device; ``n = 1`` with ``batch = n * B`` is sync
every step on ``n`` devices of batch ``B`` (the same AdamW step on the mean gradient).

It answers, in a minute a case, how much held-out loss a mode reaches at equal samples: the
part of the time-to-target figures that is the algorithm's, not the links'.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import torch

from chaos.errors import ConfigError

__all__ = ["SimConfig", "local_sim_command", "simulate"]


@dataclass(frozen=True)
class SimConfig:
    """One simulated run.

    Raises:
        ConfigError: a value out of range.
    """

    members: int = 4
    inner_steps: int = 32
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    overlap: bool = False
    batch: int | None = None
    samples: int = 24_000
    model: str = "gpt"
    seed: int = 0
    eval_every: int = 3_000

    def __post_init__(self) -> None:
        if not 1 <= self.members <= 64 or not 1 <= self.inner_steps <= 100_000:
            raise ConfigError("members must be in [1, 64] and inner_steps in [1, 100000]")
        if not 0 < self.outer_lr <= 10 or not 0 <= self.outer_momentum < 1:
            raise ConfigError("outer_lr must be in (0, 10] and outer_momentum in [0, 1)")
        if self.samples < 1 or self.eval_every < 1 or (self.batch is not None and self.batch < 1):
            raise ConfigError("samples, eval_every and batch must be positive")


def _average(deltas: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [torch.stack([d[i] for d in deltas]).mean(0) for i in range(len(deltas[0]))]


def simulate(cfg: SimConfig) -> list[tuple[int, float]]:
    """Runs ``cfg``; returns ``(cluster samples, held-out loss)`` of the global parameters
    every ``eval_every`` samples and at the end."""
    from chaos.emulate.train_models import (
        MODELS,
        Batches,
        build_model,
        eval_batch,
        load_data,
        loss_of,
    )

    torch.set_num_threads(1)
    spec = MODELS[cfg.model]
    batch = cfg.batch or spec.batch
    data = load_data(cfg.model)
    base = build_model(cfg.model, data.vocab, cfg.seed)
    ex, ey = eval_batch(cfg.model, data, spec.eval_samples)
    members = [copy.deepcopy(base) for _ in range(cfg.members)]
    opts = [torch.optim.AdamW(m.parameters(), lr=spec.lr) for m in members]
    batches = [Batches(cfg.model, data, batch, cfg.seed, r) for r in range(cfg.members)]
    gmodel = copy.deepcopy(base)
    gparams = list(gmodel.parameters())
    outer = torch.optim.SGD(gparams, lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                            nesterov=cfg.outer_momentum > 0)  # fmt: skip
    anchors = [[p.detach().clone() for p in m.parameters()] for m in members]
    pending: list[torch.Tensor] | None = None
    steps = max(1, cfg.samples // (cfg.members * batch))
    curve, next_eval = [], cfg.eval_every
    for s in range(1, steps + 1):
        for m, o, b in zip(members, opts, batches, strict=True):
            x, y = b.next()
            o.zero_grad()
            loss_of(cfg.model, m, x, y).backward()
            o.step()
        if s % cfg.inner_steps and s != steps:
            continue
        deltas = [[a - p.detach() for a, p in zip(anc, m.parameters(), strict=True)]
                  for anc, m in zip(anchors, members, strict=True)]  # fmt: skip
        step_with = pending if cfg.overlap else _average(deltas)
        if step_with is not None:
            for g, d in zip(gparams, step_with, strict=True):
                g.grad = d
            outer.step()
        pending = _average(deltas)
        with torch.no_grad():
            for m, own in zip(members, deltas, strict=True):
                for p, g, di in zip(m.parameters(), gparams, own, strict=True):
                    p.copy_(g - di if cfg.overlap else g)
        anchors = [[p.detach().clone() for p in m.parameters()] for m in members]
        if s * cfg.members * batch >= next_eval or s == steps:
            next_eval += cfg.eval_every
            with torch.no_grad():
                curve.append((s * cfg.members * batch, loss_of(cfg.model, gmodel, ex, ey).item()))
    return curve


@click.command("local-sim")
@click.option("--members", "members", default="1,4", show_default=True,
              help="Member counts, comma-separated.")
@click.option("--inner-steps", "inner", default="1,32", show_default=True,
              help="Inner steps per outer step (H), comma-separated.")
@click.option("--outer-lr", type=float, default=1.0, show_default=True)
@click.option("--outer-momentum", type=float, default=0.0, show_default=True)
@click.option("--overlap", is_flag=True, help="Apply each average one outer step late.")
@click.option("--batch", type=int, default=None, help="Per-member batch (default: the model's).")
@click.option("--samples", type=int, default=24_000, show_default=True)
@click.option("--model", type=click.Choice(["gpt", "cnn"]), default="gpt", show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path))
def local_sim_command(members: str, inner: str, outer_lr: float, outer_momentum: float,
                      overlap: bool, batch: int | None, samples: int, model: str,
                      json_path: Path | None) -> None:  # fmt: skip
    """Held-out loss at equal samples of local steps against one device and sync, without a
    network (the training arithmetic of ``chaos-emulate train``, in one process)."""
    runs = []
    try:
        cfgs = [SimConfig(int(n), int(h), outer_lr, outer_momentum, overlap, batch, samples,
                          model)  # fmt: skip
                for n in members.split(",") for h in inner.split(",")]
    except (ValueError, ConfigError) as exc:
        raise click.BadParameter(str(exc)) from exc
    for cfg in cfgs:
        t0 = time.monotonic()
        curve = simulate(cfg)
        runs.append({"config": asdict(cfg), "curve": curve, "seconds": time.monotonic() - t0})
        click.echo(f"members {cfg.members} H {cfg.inner_steps} outer ({cfg.outer_lr:g}, "
                   f"{cfg.outer_momentum:g}) overlap {cfg.overlap} batch "
                   f"{cfg.batch or 'default'}: loss {curve[-1][1]:.4f} at {curve[-1][0]} "
                   "samples")  # fmt: skip
    if json_path is not None:
        json_path.write_text(json.dumps({"runs": runs}, indent=2) + "\n")
