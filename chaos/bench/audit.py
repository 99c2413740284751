"""``chaos-bench audit``: the state audit's cost against the step time, per model.

For each model it builds the real model and optimizer (the paper's CIFAR classifiers with SGD
and momentum, GPT-2 with AdamW), times training steps (forward, backward, optimizer step) on a
synthetic batch, and times what an audited step adds on one member: the digest of the state
(:meth:`chaos.trainer.donor.Donor.audit_digest`, the manifest of the state it would serve, its
chunk addresses over every byte) and the fold of the digest into the gradient buffer. It prints
the medians and their ratios, on the audited step and spread over ``audit_every`` steps, and
writes them as JSON.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import click
import torch

from chaos.errors import ConfigError
from chaos.models.gpt2 import gpt2
from chaos.models.vision import alexnet, resnet101, vgg11
from chaos.replication.state import TrainingState
from chaos.replication.steplog import StepLog
from chaos.trainer.audit import StateAudit
from chaos.trainer.config import TrainerConfig
from chaos.trainer.donor import Donor
from chaos.trainer.gradients import GradientPacker

MODELS = ("resnet101", "vgg11", "alexnet", "gpt2-small")


class _NoJoiner:
    """The bench's donor serves nobody: publishing anything is a bug of the bench."""

    def set_step_log(self, log: StepLog | None) -> None:
        raise RuntimeError("the audit bench serves no joiner")

    def publish(self, state: TrainingState, epoch: int, step: int) -> None:
        raise RuntimeError("the audit bench serves no joiner")

    def also_serve(self, epoch: int, step: int) -> bool:
        raise RuntimeError("the audit bench serves no joiner")

    def retire(self) -> None:
        raise RuntimeError("the audit bench serves no joiner")


def _build(name: str, batch: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """The model, its optimizer and a closure computing one batch's loss."""
    torch.manual_seed(0)
    if name.startswith("gpt2-"):
        model: torch.nn.Module = gpt2(name.removeprefix("gpt2-"))
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
        idx = torch.randint(0, 50257, (batch, 128))

        def loss() -> torch.Tensor:
            logits = model(idx[:, :-1])
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())

        return model, opt, loss
    builders = {"resnet101": resnet101, "vgg11": vgg11, "alexnet": alexnet}
    if name not in builders:
        raise ConfigError(f"unknown model {name!r}; one of {', '.join(MODELS)}")
    model = builders[name]()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    side = 64 if name == "alexnet" else 32  # CIFAR images; AlexNet's stride needs more
    x, y = torch.randn(batch, 3, side, side), torch.randint(0, 10, (batch,))

    def vision_loss() -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(x), y)

    return model, opt, vision_loss


def measure(name: str, batch: int, steps: int, audits: int, audit_every: int) -> dict[str, Any]:
    """Median step time and audit cost of one model (see the module)."""
    model, opt, loss_fn = _build(name, batch)
    params = [p for g in opt.param_groups for p in g["params"]]
    packer = GradientPacker(params)
    step_s = []
    for i in range(steps + 1):  # the first step creates the optimizer state: not timed
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
        if i:
            step_s.append(time.perf_counter() - t0)
    donor = Donor(model, opt, "bench", _NoJoiner(), lambda kind, **f: None, join_timeout_s=1.0,
                  poll_interval_s=0.1, replication_timeout_s=1.0, pull_window=1)  # fmt: skip
    audit = StateAudit("a", audit_every, donor.audit_digest)
    flat = packer.pack(None)
    digest_s, fold_s = [], []
    for _ in range(audits):
        t0 = time.perf_counter()
        donor.audit_digest(audit_every)
        t1 = time.perf_counter()
        audit.unfold(audit.fold(flat, audit_every, ["a", "b", "c"]))
        fold_s.append(time.perf_counter() - t1)
        digest_s.append(t1 - t0)
    state_bytes = sum(donor._capture_for_serving(0, 0).tensor_sizes())
    step, dig, fold = (statistics.median(v) for v in (step_s, digest_s, fold_s))
    return {
        "model": name,
        "state_bytes": state_bytes,
        "batch": batch,
        "step_s": step,
        "digest_s": dig,
        "fold_s": fold,
        "audited_step_ratio": (dig + fold) / step,
        "amortized_ratio": (dig + fold) / (audit_every * step),
        "digest_gb_per_s": state_bytes / dig / 1e9,
    }


@click.command("audit")
@click.option("--models", default=",".join(MODELS), show_default=True,
              help="comma-separated: " + ", ".join(MODELS))  # fmt: skip
@click.option("--batch", type=int, default=32, show_default=True,
              help="samples per step (GPT-2: sequences of 128 tokens; use fewer)")  # fmt: skip
@click.option("--gpt2-batch", type=int, default=4, show_default=True)
@click.option("--steps", type=int, default=5, show_default=True, help="timed training steps")
@click.option("--audits", type=int, default=5, show_default=True, help="timed digests")
@click.option("--audit-every", type=int, default=TrainerConfig.audit_every, show_default=True,
              help="TrainerConfig.audit_every the cost is spread over")  # fmt: skip
@click.option("--threads", type=int, default=0, help="torch threads (0: torch's default)")
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench_audit.json"),
              show_default=True)  # fmt: skip
def audit_command(models: str, batch: int, gpt2_batch: int, steps: int, audits: int,
                  audit_every: int, threads: int, out: Path) -> None:  # fmt: skip
    """The state audit's cost (digest + fold) against the median step time, per model."""
    for label, v in (("--steps", steps), ("--audits", audits), ("--audit-every", audit_every),
                     ("--batch", batch), ("--gpt2-batch", gpt2_batch)):  # fmt: skip
        if v < 1:
            raise click.BadParameter(f"{label} must be at least 1, got {v}")
    if threads:
        torch.set_num_threads(threads)
    rows = []
    for name in [m.strip() for m in models.split(",") if m.strip()]:
        b = gpt2_batch if name.startswith("gpt2-") else batch
        try:
            row = measure(name, b, steps, audits, audit_every)
        except ConfigError as exc:
            raise click.BadParameter(str(exc)) from exc
        rows.append(row)
        click.echo(f"{name:<12} state {row['state_bytes'] / 2**20:8.1f} MiB  step "
                   f"{row['step_s'] * 1e3:8.1f} ms  digest {row['digest_s'] * 1e3:7.1f} ms  "
                   f"fold {row['fold_s'] * 1e3:6.2f} ms  audited step +"
                   f"{row['audited_step_ratio'] * 100:6.2f} %  per step (every {audit_every}) "
                   f"{row['amortized_ratio'] * 100:6.3f} %")  # fmt: skip
    result = {"bench": "audit", "audit_every": audit_every, "torch_threads":
              torch.get_num_threads(), "medians_of": {"steps": steps, "audits": audits},
              "models": rows}  # fmt: skip
    out.write_text(json.dumps(result, indent=2))
    click.echo(f"wrote {out}")
