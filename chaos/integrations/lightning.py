"""Lightning (``lightning.pytorch``) on an elastic cluster.

The lines a module and its script add (``docs/lightning.md``)::

    from chaos import ElasticOptimizer
    from chaos.integrations.lightning import ChaosLightningCallback
    def configure_optimizers(self):
        return ElasticOptimizer(torch.optim.AdamW(self.parameters(), lr=3e-4), self, join=JOIN,
                                scheduler=lambda o: LambdaLR(o, warmup))
    trainer = L.Trainer(max_steps=5000, callbacks=[ChaosLightningCallback()])

Lightning calls ``configure_optimizers`` once the module is on its device: building the
:class:`ElasticOptimizer` there joins the cluster (a joiner's module, optimizer state and
schedule come out equal to the members'). Its ``step()`` is the cluster's step: the gradients
(accumulated over ``accumulate_grad_batches`` by Lightning) are averaged over the members,
clipped, stepped and scheduled on every member alike. :class:`ChaosLightningCallback` keeps
Lightning's bookkeeping on the cluster's clock:

- ``trainer.global_step`` is the cluster's step after every optimizer step (a joiner's first
  step moves it to the step it entered at), so ``max_steps``, logging and checkpointing follow
  the cluster: every member stops at the same step;
- ``trainer.current_epoch`` is the cluster's epoch (its step over this device's optimizer steps
  per epoch), and the loader's epochs end where the cluster's do: a joiner's loader, which
  starts at its beginning, ends its first epoch when the cluster's epoch ends (the callback
  makes the module's ``on_train_batch_start`` answer -1 once, Lightning's way to end an epoch);
- ``gradient_clip_val`` (by norm) clips the *averaged* gradient: the callback moves it onto the
  optimizer when training starts (Lightning would clip each member's local gradient inside the
  optimizer's closure, before the average).

What stays local: each device's data (its own shard, its own order within an epoch).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import lightning.pytorch as pl

from chaos.errors import ConfigError
from chaos.trainer.elastic_optimizer import ElasticOptimizer

__all__ = ["ChaosLightningCallback"]

log = logging.getLogger("chaos.integrations.lightning")


class ChaosLightningCallback(pl.Callback):
    """Keeps a Lightning ``Trainer``'s step, stop and clipping on the cluster's.

    The module's ``configure_optimizers`` returns one :class:`ElasticOptimizer` (alone, or in
    Lightning's dictionary form with its ``scheduler`` as the ``lr_scheduler``).
    """

    def __init__(self) -> None:
        self.optimizer: ElasticOptimizer | None = None
        self._loader_epoch: int | None = None  # the cluster's epoch this loader's epoch is in
        self._end_epoch = False  # the cluster's epoch ended: end the loader's at the next batch

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Finds the :class:`ElasticOptimizer`, moves ``gradient_clip_val`` onto it and starts
        Lightning's step count at the cluster's.

        Raises:
            ConfigError: no or several optimizers, one that is not an
                :class:`ElasticOptimizer`, clipping by value, or a ``gradient_clip_val`` that
                differs from the optimizer's ``clip_grad_norm``.
        """
        self.optimizer = _elastic(trainer.optimizers)
        self._take_clipping(trainer, self.optimizer)
        _set_global_step(trainer, self.optimizer.cluster_step)
        self._wrap_batch_start(pl_module)
        spe = _steps_per_epoch(trainer)
        if spe is not None:
            self._loader_epoch = self.optimizer.cluster_step // spe
            _set_current_epoch(trainer, self._loader_epoch)

    def _wrap_batch_start(self, module: pl.LightningModule) -> None:
        """Makes the module's ``on_train_batch_start`` answer -1 (end the epoch) once when the
        cluster's epoch ended; otherwise it is the module's own."""
        own = module.on_train_batch_start

        def on_train_batch_start(batch: Any, batch_idx: int) -> int | None:
            if self._end_epoch:
                self._end_epoch = False
                return -1
            return own(batch, batch_idx)

        module.on_train_batch_start = on_train_batch_start  # type: ignore[method-assign]

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A new epoch began (the loader's own end, or one the cluster's made): nothing to end."""
        self._end_epoch = False

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Sets ``global_step`` to the cluster's step (after an optimizer step, or a joiner's
        entry), and ends the loader's epoch at the next batch when the cluster's ended."""
        if self.optimizer is None:
            return
        step = self.optimizer.cluster_step
        if trainer.global_step != step:
            _set_global_step(trainer, step)
        spe = _steps_per_epoch(trainer)
        if spe is None:
            return
        epoch = step // spe
        if self._loader_epoch is not None and epoch > self._loader_epoch:
            self._end_epoch = True
        self._loader_epoch = epoch

    @staticmethod
    def _take_clipping(trainer: pl.Trainer, opt: ElasticOptimizer) -> None:
        value = trainer.gradient_clip_val
        if value is None or value <= 0:
            return
        algorithm = trainer.gradient_clip_algorithm  # None: Lightning's default, by norm
        if algorithm is not None and getattr(algorithm, "value", algorithm) != "norm":
            raise ConfigError("gradient_clip_algorithm must be 'norm' on an elastic cluster: the "
                              "averaged gradient is clipped by its norm")  # fmt: skip
        if opt.max_grad_norm is not None and opt.max_grad_norm != float(value):
            raise ConfigError(
                f"gradient_clip_val {value} and the ElasticOptimizer's clip_grad_norm "
                f"{opt.max_grad_norm} differ: set one of them"
            )
        opt.max_grad_norm = float(value)
        trainer.gradient_clip_val = None  # Lightning would clip the local gradient
        log.info("gradient_clip_val %s clips the averaged gradient", value)


def _elastic(optimizers: list[Any]) -> ElasticOptimizer:
    """The one :class:`ElasticOptimizer` among Lightning's optimizers."""
    if len(optimizers) != 1:
        raise ConfigError(f"configure_optimizers must return one ElasticOptimizer, got "
                          f"{len(optimizers)} optimizers")  # fmt: skip
    opt = optimizers[0]
    for _ in range(3):  # Lightning may wrap it (LightningOptimizer keeps it as _optimizer)
        if isinstance(opt, ElasticOptimizer):
            return opt
        opt = getattr(opt, "_optimizer", getattr(opt, "optimizer", None))
    raise ConfigError(
        "configure_optimizers must return an ElasticOptimizer (wrap the torch optimizer: "
        "ElasticOptimizer(torch.optim.AdamW(...), self, join=...))"
    )


def _set_global_step(trainer: pl.Trainer, step: int) -> None:
    """Sets the optimizer-step counter Lightning's ``global_step`` reads."""
    loop = trainer.fit_loop.epoch_loop
    if trainer.lightning_module.automatic_optimization:
        total = loop.automatic_optimization.optim_progress.optimizer.step.total
    else:
        total = loop.manual_optimization.optim_step_progress.total
    total.ready = total.completed = step


def _steps_per_epoch(trainer: pl.Trainer) -> int | None:
    """Optimizer steps per epoch of this device's loader (``None``: not known, e.g. a stream)."""
    batches = trainer.num_training_batches
    if not isinstance(batches, int) or batches <= 0:
        return None
    return max(1, math.ceil(batches / max(1, trainer.accumulate_grad_batches)))


def _set_current_epoch(trainer: pl.Trainer, epoch: int) -> None:
    """Sets the epoch counter Lightning's ``current_epoch`` reads (a joiner's, at its start)."""
    progress = trainer.fit_loop.epoch_progress
    for tracker in (progress.current, progress.total):  # _ProcessedTrackers: all four counts
        for count in ("ready", "started", "processed", "completed"):
            setattr(tracker, count, epoch)
