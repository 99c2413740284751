"""One member of a cluster that trains under Lightning.

A small LightningModule (a two-layer classifier) whose ``configure_optimizers`` returns an
:class:`ElasticOptimizer` over AdamW with a warmup schedule; the Lightning ``Trainer`` runs with
``accumulate_grad_batches`` and ``gradient_clip_val``, as a Lightning script sets them; the only
Chaos lines are the optimizer and the :class:`ChaosLightningCallback`. Each optimizer step
appends a JSON line to ``--out`` (the same records as ``hf_worker.py``); at the end, a ``done``
line.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import lightning.pytorch as pl
import torch
from framework_worker import done_record, epoch_record, parse_args, step_record
from torch.optim.lr_scheduler import LambdaLR

from chaos import ElasticOptimizer
from chaos.integrations.lightning import ChaosLightningCallback
from chaos.trainer.worker import local_data, write_record


class Classifier(pl.LightningModule):
    """A two-layer classifier; its optimizer joins the cluster."""

    def __init__(self, member: argparse.Namespace) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                       torch.nn.Linear(64, 4))  # fmt: skip
        self.member = member
        self.elastic: ElasticOptimizer | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        m = self.member
        self.elastic = ElasticOptimizer(
            torch.optim.AdamW(self.parameters(), lr=1e-2), self, join=m.join, node_id=m.id,
            listen=m.listen, daemon_args=tuple(m.daemon_arg),
            scheduler=lambda o: LambdaLR(o, lambda s: min(1.0, (s + 1) / 20) * 0.999**s),
        )  # fmt: skip
        return self.elastic


class Record(pl.Callback):
    """Appends each optimizer step's and epoch start's record; paces the batches."""

    def __init__(self, out: Any, pace: float) -> None:
        self.out, self.pace, self.last = out, pace, -1

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, i: int) -> None:
        time.sleep(self.pace)

    def on_train_epoch_start(self, trainer: pl.Trainer, module: Any) -> None:
        write_record(self.out, epoch_record(module.elastic, trainer.current_epoch))

    def on_train_batch_end(
        self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, i: int
    ) -> None:
        opt = module.elastic
        if opt.cluster_step == self.last:
            return  # an accumulation batch: no optimizer step
        self.last = opt.cluster_step
        write_record(self.out, step_record(opt, module, trainer.global_step,
                                           trainer.current_epoch))  # fmt: skip


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    xs, ys = local_data(args.id, 4096, 16, 4)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=8,
                                         shuffle=True)  # fmt: skip
    module = Classifier(args)
    with open(args.out, "a") as out:
        trainer = pl.Trainer(
            max_steps=args.max_steps, accumulate_grad_batches=2, gradient_clip_val=1.0,
            accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
            callbacks=[ChaosLightningCallback(), Record(out, args.step_time / 2)],
        )  # fmt: skip
        trainer.fit(module, loader)
        opt = module.elastic
        write_record(out, done_record(opt, module, trainer.global_step))
    opt.close()


if __name__ == "__main__":
    main()
