"""A nanoGPT-style training loop made elastic with Chaos: the few lines it takes.

One command starts a whole cluster on this machine::

    python examples/nanogpt_style.py --nodes 3

The worker is the shape of nanoGPT's ``train.py``: a GPT whose output head is tied to its token
embedding, AdamW with two parameter groups (weight decay on matrices, none on biases and
LayerNorms), a warmup + cosine learning rate, gradient accumulation over micro-steps, a
``GradScaler`` (disabled on CPU in float32, as nanoGPT's is outside float16) and gradient
clipping. The lines Chaos adds or changes are marked ``# chaos:``; everything else is the usual
loop. Three things move into the Trainer:

- the learning-rate schedule is a ``LambdaLR`` in ``extra_state``, stepped in ``after_step``
  (nanoGPT sets ``lr`` from the iteration number by hand; the scheduler's state must travel to
  a joiner, and it does when the Trainer knows it);
- ``scaler.unscale_`` and the clipping run in ``before_step``, on the averaged gradient;
- ``scaler.step(optimizer)`` is the ``step_fn``, ``scaler.update()`` runs in ``after_step``.

``n1`` starts the cluster, ``n2`` joins, ``n3`` joins in the middle of training, ``n2`` leaves,
and the rest leave at the end (the examples' scenario, ``examples/elastic.py``). Each worker
trains on its own part of ``examples/lighthouse.txt`` (byte tokens) and reports the loss on a
held-out tail, the same on every member.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from elastic import EventPrinter, example_parser, launch, parse_arguments, progress
from torch import nn
from torch.nn import functional as F

from chaos.trainer import Trainer, capture_exit_event  # chaos:

HERE = Path(__file__).resolve().parent
STORY = HERE / "lighthouse.txt"

# ----------------------------------------------------------------------------- the model


class Block(nn.Module):
    """Pre-LayerNorm causal self-attention and an MLP, as in GPT-2."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A small GPT: token and position embeddings, blocks, a final LayerNorm and an output
    head whose weight is the token embedding's (weight tying)."""

    def __init__(self, vocab: int = 256, context: int = 64, dim: int = 64, layers: int = 2,
                 heads: int = 4) -> None:  # fmt: skip
        super().__init__()
        self.context = context
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in nanoGPT

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1])
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def configure_optimizers(self, weight_decay: float, lr: float) -> torch.optim.AdamW:
        """AdamW with weight decay on every 2-D tensor (matrices, embeddings) and none on the
        others (biases, LayerNorms), as nanoGPT does."""
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}  # tied: once
        decay = [p for p in params.values() if p.dim() >= 2]
        no_decay = [p for p in params.values() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]  # fmt: skip
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def get_lr_factor(it: int, warmup: int, decay_iters: int, min_ratio: float = 0.1) -> float:
    """nanoGPT's ``get_lr`` as a factor of the base rate: linear warmup, then cosine decay."""
    if it < warmup:
        return (it + 1) / (warmup + 1)
    if it > decay_iters:
        return min_ratio
    ratio = (it - warmup) / (decay_iters - warmup)
    return min_ratio + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (1.0 - min_ratio)


def get_batch(tokens: torch.Tensor, n: int, context: int, gen: torch.Generator) -> tuple:
    """``n`` random windows of ``context`` tokens and their next tokens."""
    ix = torch.randint(len(tokens) - context - 1, (n,), generator=gen)
    x = torch.stack([tokens[i : i + context] for i in ix.tolist()])
    y = torch.stack([tokens[i + 1 : i + 1 + context] for i in ix.tolist()])
    return x, y


# ----------------------------------------------------------------------------- the loop


def worker(args: argparse.Namespace) -> int:
    """One cluster member: nanoGPT's loop, until Ctrl+C / SIGTERM or ``--max-iters``."""
    torch.set_num_threads(1)
    torch.manual_seed(1337)
    tokens = torch.tensor(list(STORY.read_bytes()), dtype=torch.long)
    n_val = len(tokens) // 10
    train, val = tokens[:-n_val], tokens[-n_val:]
    part = len(train) // args.shards  # this device's own data
    mine = train[args.shard * part : (args.shard + 1) * part]
    val_x, val_y = get_batch(val, 32, args.context, torch.Generator().manual_seed(0))

    model = GPT(context=args.context)
    optimizer = model.configure_optimizers(args.weight_decay, args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda it: get_lr_factor(it, args.warmup_iters, args.lr_decay_iters)
    )
    use_fp16 = False  # float16 autocast needs a GPU; on CPU the scaler stays disabled
    scaler = torch.amp.GradScaler("cpu", enabled=use_fp16)
    trainer = Trainer(  # chaos: join the cluster (or start it); a joiner pulls the state
        model,
        optimizer,
        join=args.join,
        node_id=args.id,
        listen=args.listen,  # chaos:
        extra_state={"scheduler": scheduler, "scaler": scaler},  # chaos:
        global_batch=args.global_batch,  # chaos: None: every member uses --batch-size
    )  # chaos:
    events = EventPrinter(trainer)

    def clip() -> None:  # chaos: nanoGPT's unscale + clip, on the averaged gradient
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)

    def after() -> None:  # chaos: what advances after the step, inside update()
        scaler.update()
        scheduler.step()

    gen = torch.Generator().manual_seed(1 + args.shard)
    while trainer.step < args.max_iters:  # chaos: the cluster's iteration number
        samples = trainer.local_batch_size or args.batch_size * args.accum  # chaos:
        x, y = get_batch(mine, samples, args.context, gen)
        for xm, ym in zip(x.tensor_split(args.accum), y.tensor_split(args.accum), strict=True):
            if len(xm) == 0:
                continue
            loss = model(xm, ym) * (len(xm) / samples)  # each micro-batch's share of the mean
            scaler.scale(loss).backward()
        trainer.update(  # chaos: average, clip, step, advance the schedule
            num_samples=samples,
            before_step=clip,  # chaos:
            step_fn=lambda: scaler.step(optimizer),
            after_step=after,  # chaos:
        )  # chaos:
        trainer.check_state_replication()  # chaos:
        optimizer.zero_grad(set_to_none=True)
        events.flush()
        if trainer.step % args.log_every == 0:
            with torch.no_grad():
                val_loss = model(val_x, val_y).item()
            lr = optimizer.param_groups[0]["lr"]
            progress(trainer, lr=lr, val_loss=val_loss)
        if capture_exit_event():  # chaos: Ctrl+C or SIGTERM: leave gracefully
            break
    trainer.request_node_exit()  # chaos:
    events.flush()
    return 0


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    """Parses the command line; runs the launcher, or one worker with ``--worker``."""
    ap = example_parser(__doc__, phase_steps=40, data="the text")
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=8, help="samples per micro-step")
    ap.add_argument("--accum", type=int, default=2, help="gradient accumulation micro-steps")
    ap.add_argument("--global-batch", type=int, default=None,
                    help="samples per step over the cluster, split by device speed")  # fmt: skip
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--warmup-iters", type=int, default=10)
    ap.add_argument("--lr-decay-iters", type=int, default=200)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--max-iters", type=int, default=100_000, help="worker: stop after")
    args = parse_arguments(ap, argv)
    if args.worker:
        return worker(args)
    options = ("context", "batch_size", "accum", "lr", "weight_decay", "warmup_iters",
               "lr_decay_iters", "grad_clip", "log_every", "global_batch")  # fmt: skip
    return launch(__file__, args, options)


if __name__ == "__main__":
    sys.exit(main())
