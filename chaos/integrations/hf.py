"""Hugging Face ``transformers.Trainer`` on an elastic cluster.

The lines a script adds (``docs/huggingface.md``)::

    from chaos import ElasticOptimizer
    from chaos.integrations.hf import ChaosCallback
    opt = ElasticOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), model, join=JOIN,
                           scheduler=lambda o: get_linear_schedule_with_warmup(o, 100, 5000))
    trainer = Trainer(model, args, train_dataset=ds, optimizers=(opt, opt.scheduler),
                      callbacks=[ChaosCallback(opt)])

The optimizer's ``step()`` is the cluster's step: the gradients (accumulated over
``gradient_accumulation_steps`` micro-batches by the framework) are averaged over the members,
clipped, stepped and scheduled on every member alike. :class:`ChaosCallback` keeps the framework's
bookkeeping on the cluster's clock:

- ``state.global_step`` is the cluster's step after every optimizer step (a joiner's first step
  moves it to the step it entered at), so ``max_steps``, logging, saving and evaluation follow
  the cluster: every member stops at the same step, and a late joiner does not train
  ``max_steps`` more on its own;
- ``state.epoch`` is the cluster's step over this device's optimizer steps per epoch, and the
  data loader's epochs end where the cluster's do: a joiner's loader, which starts at its
  beginning, ends its first epoch when the cluster's epoch ends (not a full pass later), so its
  epoch count, and a sampler reseeded per epoch, follow the cluster's;
- ``max_grad_norm`` clips the *averaged* gradient: the callback moves it onto the optimizer at
  the start of training (and sets the framework's own to 0, which would clip each member's local
  gradient before the average);
- the logs carry the cluster's step, its size and the averaged gradient's norm.

What stays local: each device's data (its own shard, its own order within an epoch). On a join
the joiner's loader starts at the beginning of its shard; a shard has no position that another
device's step could name.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from chaos.errors import ConfigError
from chaos.trainer.elastic_optimizer import ElasticOptimizer

__all__ = ["ChaosCallback"]

log = logging.getLogger("chaos.integrations.hf")

NOT_STEPPED = ("the Trainer steps another optimizer than this ChaosCallback's: pass "
               "optimizers=(elastic_optimizer, elastic_optimizer.scheduler)")  # fmt: skip


class ChaosCallback(TrainerCallback):
    """Keeps a ``transformers.Trainer``'s step, epoch, stop and clipping on the cluster's.

    Args:
        optimizer: The :class:`ElasticOptimizer` given to the framework in ``optimizers=``.

    Raises:
        ConfigError: ``optimizer`` is not an :class:`ElasticOptimizer`.
    """

    def __init__(self, optimizer: ElasticOptimizer) -> None:
        if not isinstance(optimizer, ElasticOptimizer):
            raise ConfigError(f"ChaosCallback takes the ElasticOptimizer the Trainer steps, got "
                              f"{type(optimizer).__name__}")  # fmt: skip
        self.optimizer = optimizer
        self._steps_per_epoch: int | None = None
        self._last_step = -1
        self._loader_epoch: int | None = None  # the cluster's epoch this loader's epoch is in

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        """Checks that the framework holds this optimizer (when it says which), moves
        ``max_grad_norm`` onto it and starts the framework's step count at the cluster's.

        Raises:
            ConfigError: the framework steps another optimizer (``optimizers=`` was not given
                this one), or ``max_grad_norm`` differs from the optimizer's ``clip_grad_norm``.
        """
        self._check_stepped(kw.get("optimizer"))
        self._take_clipping(args)
        self._steps_per_epoch = _steps_per_epoch(kw.get("train_dataloader"),
                                                 args.gradient_accumulation_steps)  # fmt: skip
        state.global_step = self._last_step = self.optimizer.cluster_step

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> TrainerControl:
        """Sets the step and the epoch to the cluster's, ends the loader's epoch where the
        cluster's ends, and stops at ``max_steps`` of the cluster.

        Raises:
            ConfigError: the optimizer step did not move the cluster's step (the framework
                steps another optimizer: ``optimizers=`` was not given this one).
        """
        step = self.optimizer.cluster_step
        if step <= self._last_step:
            raise ConfigError(NOT_STEPPED)
        self._last_step = step
        state.global_step = step
        spe = self._steps_per_epoch
        if spe:
            state.epoch = step / spe
            epoch = step // spe
            if self._loader_epoch is not None and epoch > self._loader_epoch:
                control.should_epoch_stop = True  # the cluster's epoch ended: so does this one
            self._loader_epoch = epoch
        if state.max_steps > 0 and step >= state.max_steps:
            control.should_training_stop = True
        return control

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kw: Any,
    ) -> None:
        """Adds the cluster's step and size and the averaged gradient's norm to the logs."""
        if logs is None:
            return
        trainer = self.optimizer.trainer
        logs["cluster_step"] = trainer.step
        logs["world_size"] = trainer.world_size
        norm = self.optimizer.last_grad_norm
        if norm is not None and math.isfinite(norm):
            logs["grad_norm"] = norm

    def _check_stepped(self, stepped: Any) -> None:
        inner = stepped
        for _ in range(4):  # accelerate's AcceleratedOptimizer wraps it as .optimizer
            if inner is self.optimizer or inner is None:
                return
            inner = getattr(inner, "optimizer", None)
        raise ConfigError(NOT_STEPPED)

    def _take_clipping(self, args: TrainingArguments) -> None:
        framework = float(args.max_grad_norm or 0.0)
        if framework <= 0:
            return
        own = self.optimizer.max_grad_norm
        if own is not None and own != framework:
            raise ConfigError(f"max_grad_norm {framework} and the ElasticOptimizer's "
                              f"clip_grad_norm {own} differ: set one of them")  # fmt: skip
        self.optimizer.max_grad_norm = framework
        args.max_grad_norm = 0.0  # the framework would clip the local gradient, before averaging
        log.info("max_grad_norm %s clips the averaged gradient (the ElasticOptimizer's step)",
                 framework)  # fmt: skip


def _steps_per_epoch(loader: Any, accumulation: int) -> int | None:
    """Optimizer steps per epoch of ``loader`` (``None``: it has no length, e.g. a stream)."""
    try:
        batches = len(loader)
    except TypeError:
        return None
    return max(1, math.ceil(batches / max(1, accumulation)))
