"""The Hugging Face callback's checks and bookkeeping, with one real founder (its embedded
daemon) in this process under a real ``transformers.Trainer``: the misuse it refuses before a
step is taken, and the clipping it moves onto the averaged gradient."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import Trainer, TrainingArguments

from chaos.errors import ConfigError
from chaos.integrations.hf import ChaosCallback
from chaos.trainer.elastic_optimizer import ElasticOptimizer


class _Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(self.lin(x).squeeze(-1), labels) * 100}


class _Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(64, 4, generator=gen), torch.randn(64, generator=gen)

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


@pytest.fixture
def founder() -> Iterator[tuple[_Regression, ElasticOptimizer]]:
    model = _Regression()
    opt = ElasticOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model,
                           node_id="hf-callback")  # fmt: skip
    try:
        yield model, opt
    finally:
        opt.close()


def _args(tmp: Path, **kw: object) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp), max_steps=6, per_device_train_batch_size=8,
                             report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no",
                             **kw)  # fmt: skip


def test_the_callback_takes_only_an_elastic_optimizer() -> None:
    model = _Regression()
    with pytest.raises(ConfigError, match="ElasticOptimizer"):
        ChaosCallback(torch.optim.SGD(model.parameters(), lr=0.1))  # type: ignore[arg-type]


def test_a_trainer_that_steps_another_optimizer_is_refused(
    founder: tuple[_Regression, ElasticOptimizer], tmp_path: Path
) -> None:
    model, opt = founder
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=_Rows(),
                      callbacks=[ChaosCallback(opt)])  # fmt: skip
    with pytest.raises(ConfigError, match="optimizers=\\(elastic_optimizer"):
        trainer.train()
    assert opt.cluster_step == 0


def test_max_grad_norm_clips_the_averaged_gradient_and_steps_follow_the_cluster(
    founder: tuple[_Regression, ElasticOptimizer], tmp_path: Path
) -> None:
    model, opt = founder
    args = _args(tmp_path, max_grad_norm=0.25, gradient_accumulation_steps=2)
    trainer = Trainer(model=model, args=args, train_dataset=_Rows(),
                      optimizers=(opt, None), callbacks=[ChaosCallback(opt)])  # fmt: skip
    trainer.train()
    assert opt.max_grad_norm == 0.25 and args.max_grad_norm == 0.0  # moved onto the optimizer
    assert opt.last_grad_norm is not None and opt.last_grad_norm > 0.25  # it did clip
    assert trainer.state.global_step == opt.cluster_step == 6


def test_two_different_clip_norms_are_refused(tmp_path: Path) -> None:
    model = _Regression()
    opt = ElasticOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model,
                           node_id="hf-clip", clip_grad_norm=2.0)  # fmt: skip
    try:
        trainer = Trainer(model=model, args=_args(tmp_path, max_grad_norm=1.0),
                          train_dataset=_Rows(), optimizers=(opt, None),
                          callbacks=[ChaosCallback(opt)])  # fmt: skip
        with pytest.raises(ConfigError, match="differ"):
            trainer.train()
    finally:
        opt.close()
