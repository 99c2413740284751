"""The Lightning callback's checks and bookkeeping, with one real founder (its embedded daemon)
in this process under a real Lightning ``Trainer``: the misuse it refuses before a step is
taken, and the clipping it moves onto the averaged gradient."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from chaos.errors import ConfigError
from chaos.integrations.lightning import ChaosLightningCallback
from chaos.trainer.elastic_optimizer import ElasticOptimizer


class _Module(pl.LightningModule):
    def __init__(self, elastic: bool = True, clip: float | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 1)
        self.elastic, self.clip = elastic, clip
        self.opt: ElasticOptimizer | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.lin(x).squeeze(-1), y) * 100

    def configure_optimizers(self) -> Any:
        sgd = torch.optim.SGD(self.parameters(), lr=0.01)
        if not self.elastic:
            return sgd
        self.opt = ElasticOptimizer(sgd, self, node_id="lightning-callback",
                                    clip_grad_norm=self.clip)  # fmt: skip
        return self.opt


def _loader() -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    gen = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=gen),
                                        torch.randn(64, generator=gen))  # fmt: skip
    return torch.utils.data.DataLoader(ds, batch_size=8)


def _fit(module: _Module, **kw: Any) -> tuple[pl.Trainer, int]:
    """Fits ``module`` for 5 steps; returns the trainer and the cluster's step at the end."""
    trainer = pl.Trainer(max_steps=5, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[ChaosLightningCallback()],
                         **kw)  # fmt: skip
    try:
        trainer.fit(module, _loader())
        return trainer, module.opt.cluster_step if module.opt is not None else -1
    finally:
        if module.opt is not None:
            module.opt.close()


def test_a_plain_optimizer_is_refused() -> None:
    with pytest.raises(ConfigError, match="must return an ElasticOptimizer"):
        _fit(_Module(elastic=False))


def test_clipping_by_value_is_refused() -> None:
    with pytest.raises(ConfigError, match="'norm'"):
        _fit(_Module(), gradient_clip_val=0.5, gradient_clip_algorithm="value")


def test_two_different_clip_norms_are_refused() -> None:
    with pytest.raises(ConfigError, match="differ"):
        _fit(_Module(clip=2.0), gradient_clip_val=0.5)


def test_gradient_clip_val_clips_the_averaged_gradient_and_steps_follow_the_cluster() -> None:
    module = _Module()
    trainer, cluster_step = _fit(module, gradient_clip_val=0.25, accumulate_grad_batches=2)
    opt = module.opt
    assert opt is not None and opt.max_grad_norm == 0.25 and trainer.gradient_clip_val is None
    assert opt.last_grad_norm is not None and opt.last_grad_norm > 0.25  # it did clip
    assert trainer.global_step == cluster_step == 5
