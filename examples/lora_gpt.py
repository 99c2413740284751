"""Elastic LoRA fine-tuning of a small GPT-2-style decoder on local text.

One command starts a whole cluster on this machine::

    python examples/lora_gpt.py --nodes 3

First the launcher pretrains the base model once, briefly, on this project's own documentation
(``docs/*.md``, byte-level tokens), and saves it. Then it starts 3 worker processes, each with
its own embedded ``chaos-daemon``, that fine-tune LoRA adapters on ``examples/lighthouse.txt``,
a short story written for this project: the base weights stay frozen and only the adapters are
trained (and given to the optimizer), so only they are averaged over the cluster. ``n1``
starts the cluster, ``n2`` joins, ``n3`` joins in the middle of training, ``n2`` leaves
gracefully, and finally everyone leaves; ``n1`` prints a sample of the fine-tuned model.

Each worker fine-tunes on its own contiguous part of the story and reports the loss on a
held-out tail, which every member evaluates the same way.

The model is written in plain torch: token and position embeddings, pre-LayerNorm blocks of
causal self-attention and an MLP, and a language-model head tied to the token embedding, as in
GPT-2, only much smaller.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch
from elastic import EventPrinter, example_parser, launch, parse_arguments, progress
from torch import nn
from torch.nn import functional as F

from chaos.trainer import Trainer, capture_exit_event

HERE = Path(__file__).resolve().parent
STORY = HERE / "lighthouse.txt"
DOCS = HERE.parent / "docs"

# ----------------------------------------------------------------------------- the model


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update ``(alpha / r) * B @ A``.

    ``B`` starts at zero, so the wrapped layer starts out exactly equal to the base layer.

    Args:
        base: The pretrained layer; its weight and bias are frozen.
        rank: Rank ``r`` of the update. Higher adapts more, at more parameters.
        alpha: Scale of the update; ``alpha / rank`` multiplies it.

    Raises:
        ValueError: a non-positive rank.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank must be at least 1, got {rank}")
        self.base = base
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(rank))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scale


class Block(nn.Module):
    """A pre-LayerNorm transformer block: causal self-attention, then an MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        self.c_attn: nn.Module = nn.Linear(dim, 3 * dim)
        self.c_proj: nn.Module = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """A GPT-2-style decoder over bytes (vocabulary 256).

    Args:
        context: Longest sequence, in tokens.
        dim: Embedding width.
        layers: Number of transformer blocks.
        heads: Attention heads per block; must divide ``dim``.

    Raises:
        ValueError: ``heads`` does not divide ``dim``.
    """

    def __init__(self, context: int = 64, dim: int = 64, layers: int = 3, heads: int = 4) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"heads ({heads}) must divide dim ({dim})")
        self.context = context
        self.wte = nn.Embedding(256, dim)
        self.wpe = nn.Embedding(context, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.T  # logits; the head is tied to the embedding

    def add_lora(self, rank: int, alpha: float) -> list[nn.Parameter]:
        """Freezes every weight and wraps the attention projections with LoRA adapters.

        Returns:
            The adapters' parameters: the only trainable ones.
        """
        for p in self.parameters():
            p.requires_grad_(False)
        for block in self.blocks:
            if not isinstance(block, Block):
                raise TypeError(f"unexpected block {type(block).__name__}")
            for name in ("c_attn", "c_proj"):
                layer = getattr(block, name)
                if not isinstance(layer, nn.Linear):
                    raise TypeError(f"{name} already has an adapter")
                setattr(block, name, LoRALinear(layer, rank, alpha))
        return [p for p in self.parameters() if p.requires_grad]

    @torch.no_grad()
    def sample(self, prompt: str, chars: int, temperature: float = 0.8, seed: int = 0) -> str:
        """Continues ``prompt`` by ``chars`` bytes, sampled with a fixed seed."""
        gen = torch.Generator().manual_seed(seed)
        idx = torch.tensor([list(prompt.encode())], dtype=torch.long)
        for _ in range(chars):
            logits = self(idx[:, -self.context :])[0, -1] / temperature
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
            idx = torch.cat([idx, nxt.view(1, 1)], dim=1)
        return bytes(idx[0].tolist()).decode(errors="replace")


# ----------------------------------------------------------------------------- data


def as_tokens(text: str) -> torch.Tensor:
    """Byte-level tokens of ``text``."""
    return torch.tensor(list(text.encode()), dtype=torch.long)


def windows(tokens: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, ...]:
    """Inputs and next-byte targets of the windows that start at ``starts``."""
    rows = starts.view(-1, 1) + torch.arange(context + 1).view(1, -1)
    batch = tokens[rows]
    return batch[:, :-1], batch[:, 1:]


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy."""
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def pretrain(
    text: str, steps: int, out: Path, context: int, batch: int = 16, seed: int = 0
) -> float:
    """Trains the base model on ``text`` (all weights) and saves its ``state_dict`` to ``out``.

    Returns:
        The last training loss.

    Raises:
        ValueError: the text is shorter than one window, or bad steps or batch.
    """
    torch.manual_seed(seed)
    model = TinyGPT(context=context)
    tokens = as_tokens(text)
    if len(tokens) <= context + 1:
        raise ValueError(f"the pretraining text has only {len(tokens)} bytes")
    if steps < 0 or batch < 1:
        raise ValueError(f"bad pretraining steps {steps} or batch {batch}")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    last = float("nan")
    for _ in range(steps):
        starts = torch.randint(0, len(tokens) - context - 1, (batch,), generator=gen)
        x, y = windows(tokens, starts, context)
        opt.zero_grad()
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
        last = loss.item()
    torch.save(model.state_dict(), out)
    return last


# ----------------------------------------------------------------------------- a worker


def worker(args: argparse.Namespace) -> int:
    """One cluster member: fine-tunes the adapters until Ctrl+C / SIGTERM or ``--max-steps``."""
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same adapters everywhere; a joiner's are replaced anyway
    model = TinyGPT(context=args.context)
    if args.base:
        model.load_state_dict(torch.load(args.base, weights_only=True))
    adapters = model.add_lora(args.rank, args.alpha)
    optimizer = torch.optim.AdamW(adapters, lr=args.lr, weight_decay=0.0)

    tokens = as_tokens(STORY.read_text())
    n_val = len(tokens) // 10
    train, val = tokens[:-n_val], tokens[-n_val:]
    part = len(train) // args.shards  # this device's local data: one contiguous part
    mine = train[args.shard * part : (args.shard + 1) * part]
    if len(mine) <= args.context + 1 or len(val) <= args.context + 1:
        raise ValueError(f"too little text for {args.shards} shards of context {args.context}")
    val_x, val_y = windows(val, torch.arange(0, len(val) - args.context - 1, 16), args.context)

    trainer = Trainer(model, optimizer, join=args.join, node_id=args.id, listen=args.listen)
    events = EventPrinter(trainer)
    batches = torch.Generator().manual_seed(1 + args.shard)
    while trainer.step < args.max_steps:
        starts = torch.randint(0, len(mine) - args.context - 1, (args.batch,), generator=batches)
        x, y = windows(mine, starts, args.context)
        optimizer.zero_grad()
        loss = lm_loss(model, x, y)
        loss.backward()
        trainer.update()  # averages the adapters' gradients over the members, then steps
        trainer.check_state_replication()
        events.flush()
        if trainer.step % args.log_every == 0:
            with torch.no_grad():
                val_loss = lm_loss(model, val_x, val_y).item()
            progress(trainer, loss=loss.item(), val_loss=val_loss)
        if capture_exit_event():  # Ctrl+C or SIGTERM: leave gracefully
            break
    trainer.request_node_exit()
    events.flush()
    if args.sample_chars > 0:
        text = model.sample("The keeper", args.sample_chars)
        print(f"[{args.id}] sample: {text!r}", flush=True)
    return 0


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    """Parses the command line; runs the launcher, or one worker with ``--worker``."""
    ap = example_parser(__doc__, phase_steps=60, data="the story")
    ap.add_argument("--pretrain-steps", type=int, default=250, help="base model steps on docs/")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank")
    ap.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--base", default=None, help="worker: pretrained base state_dict file")
    ap.add_argument("--max-steps", type=int, default=100_000, help="worker: stop after")
    ap.add_argument("--sample-chars", type=int, default=0, help="worker: sample at the end")
    args = parse_arguments(ap, argv)
    if args.worker:
        return worker(args)
    docs = sorted(DOCS.glob("*.md"))
    if not docs:
        ap.error(f"no pretraining text: {DOCS} has no .md files")

    with tempfile.TemporaryDirectory(prefix="chaos-lora-") as tmp:
        base = Path(tmp) / "base.pt"
        corpus = "\n\n".join(p.read_text() for p in docs)
        print(f"== pretraining the base model on {len(docs)} docs ({len(corpus)} bytes)")
        loss = pretrain(corpus, args.pretrain_steps, base, args.context)
        print(f"== base model ready: loss {loss:.3f} after {args.pretrain_steps} steps", flush=True)

        def extra(node_id: str) -> list[str]:  # n1 prints a sample of the fine-tuned model
            return ["--base", str(base)] + (["--sample-chars", "120"] if node_id == "n1" else [])

        options = ("context", "batch", "rank", "alpha", "lr", "log_every")
        return launch(__file__, args, options, extra)


if __name__ == "__main__":
    sys.exit(main())
