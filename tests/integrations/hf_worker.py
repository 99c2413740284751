"""One member of a cluster that trains under Hugging Face ``transformers.Trainer``.

A tiny GPT-2 built from a config (random weights, nothing downloaded), AdamW with a warmup and
linear-decay schedule, gradient accumulation and ``max_grad_norm``, exactly as an HF script sets
them; the only Chaos lines are the :class:`ElasticOptimizer`, ``optimizers=`` and the
:class:`ChaosCallback`. Each optimizer step appends a JSON line to ``--out``: the cluster's step,
the framework's ``global_step``, the world size, the learning rate and a digest of the model and
the optimizer state. At the end, a ``done`` line.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from framework_worker import done_record, epoch_record, parse_args, step_record
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    get_linear_schedule_with_warmup,
)

from chaos import ElasticOptimizer
from chaos.integrations.hf import ChaosCallback
from chaos.trainer.worker import write_record

VOCAB, SEQ = 96, 16


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """This device's own random token sequences (seeded by its id)."""

    def __init__(self, node_id: str, rows: int = 4096) -> None:
        gen = torch.Generator().manual_seed(sum(map(ord, node_id)))
        self.ids = torch.randint(0, VOCAB, (rows, SEQ), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Record(TrainerCallback):  # type: ignore[misc]
    """Appends each optimizer step's and epoch start's record; paces the steps."""

    def __init__(self, opt: ElasticOptimizer, model: torch.nn.Module, out: Any, pace: float):
        self.opt, self.model, self.out, self.pace = opt, model, out, pace

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        time.sleep(self.pace)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        write_record(self.out, epoch_record(self.opt, state.epoch))

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        write_record(self.out, step_record(self.opt, self.model, state.global_step, state.epoch))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2,
                                       n_head=2, tie_word_embeddings=True,
                                       bos_token_id=0, eos_token_id=0))  # fmt: skip
    opt = ElasticOptimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01), model,
        join=args.join, node_id=args.id, listen=args.listen,
        daemon_args=tuple(args.daemon_arg),
        scheduler=lambda o: get_linear_schedule_with_warmup(o, 20, args.max_steps),
    )  # fmt: skip
    hf_args = TrainingArguments(
        output_dir=str(args.out.with_suffix(".hf")), max_steps=args.max_steps,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=1.0,
        logging_steps=50, save_strategy="no", report_to=[], use_cpu=True,
        disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )  # fmt: skip
    with open(args.out, "a") as out:
        callbacks = [ChaosCallback(opt), Record(opt, model, out, args.step_time)]
        trainer = Trainer(model=model, args=hf_args, train_dataset=Tokens(args.id),
                          optimizers=(opt, opt.scheduler), callbacks=callbacks)  # fmt: skip
        trainer.train()
        write_record(out, done_record(opt, model, trainer.state.global_step))
    opt.close()


if __name__ == "__main__":
    main()
