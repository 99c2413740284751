"""GPT-2 language models and a LoRA adapter for them.

The layout follows the original GPT-2 (pre-norm blocks, learned position embeddings, a final
layer norm and an LM head tied to the token embedding), written from scratch. With vocabulary
50257 and context 1024 the parameter counts are 124,439,808 (small), 354,823,168 (medium) and
774,030,080 (large), the tied head counted once.

The projections are ``nn.Linear`` (weight ``(out, in)``), where the released checkpoints use a
transposed "Conv1D" (weight ``(in, out)``); element counts and tensor order are the same. The
causal mask is not stored as a buffer: attention uses ``is_causal=True``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "GPT2",
    "GPT2_CONFIGS",
    "GPT2Config",
    "LoRALinear",
    "apply_lora",
    "gpt2",
]


@dataclass(frozen=True)
class GPT2Config:
    """Shape of a GPT-2 model.

    Args:
        n_layer: Number of transformer blocks.
        n_embd: Model width; must be divisible by ``n_head``.
        n_head: Number of attention heads.
        vocab_size: Token vocabulary size.
        n_ctx: Maximum sequence length (size of the position embedding).

    Raises:
        ValueError: If a field is not positive or ``n_embd`` is not divisible by ``n_head``.
    """

    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int = 50257
    n_ctx: int = 1024

    def __post_init__(self) -> None:
        for field in ("n_layer", "n_embd", "n_head", "vocab_size", "n_ctx"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPT2Config.{field} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")


GPT2_CONFIGS: dict[str, GPT2Config] = {
    "small": GPT2Config(n_layer=12, n_embd=768, n_head=12),
    "medium": GPT2Config(n_layer=24, n_embd=1024, n_head=16),
    "large": GPT2Config(n_layer=36, n_embd=1280, n_head=20),
}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection (``c_attn``).

    Args:
        cfg: Model shape.
    """

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn: nn.Module = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` of shape ``(N, T, C)``; returns the same shape."""
        n, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(n, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(n, t, c))


class MLP(nn.Module):
    """Position-wise feed-forward layer (width 4 * n_embd, GELU).

    Args:
        cfg: Model shape.
    """

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the feed-forward layer."""
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``.

    Args:
        cfg: Model shape.
    """

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block."""
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    """GPT-2 language model with the LM head tied to the token embedding.

    ``named_parameters()`` lists the tied weight once (as ``wte.weight``).

    Args:
        cfg: Model shape.
    """

    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_ctx, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Map token ids ``(N, T)`` to next-token logits ``(N, T, vocab_size)``.

        Raises:
            ValueError: If the sequence is longer than ``n_ctx``.
        """
        t = idx.shape[1]
        if t > self.cfg.n_ctx:
            raise ValueError(f"sequence length {t} exceeds the context {self.cfg.n_ctx}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update ``(alpha / r) * B @ A``.

    ``lora_B`` starts at zero, so the wrapped layer initially computes exactly the base layer.

    Args:
        base: The layer to adapt; its parameters are frozen (``requires_grad=False``).
        rank: Rank ``r`` of the update.
        alpha: Scaling numerator; the update is scaled by ``alpha / rank``.

    Raises:
        ValueError: If ``rank`` is not a positive int or exceeds the layer's dimensions.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float = 16.0) -> None:
        super().__init__()
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"LoRA rank must be a positive int, got {rank!r}")
        if rank > min(base.in_features, base.out_features):
            raise ValueError(
                f"LoRA rank {rank} exceeds the layer shape "
                f"({base.out_features}, {base.in_features})"
            )
        self.base = base
        for p in self.base.parameters():
            p.requires_grad_(False)
        dev, dtype = base.weight.device, base.weight.dtype
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=dev, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=dev, dtype=dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the base layer plus the scaled low-rank update."""
        return self.base(x) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scaling


def apply_lora(model: GPT2, rank: int = 8, alpha: float = 16.0) -> GPT2:
    """Freeze ``model`` and wrap every block's ``attn.c_attn`` in a :class:`LoRALinear`.

    Afterwards the only parameters with ``requires_grad=True`` are the ``lora_A``/``lora_B``
    pairs, in block order.

    Args:
        model: The model to adapt, modified in place.
        rank: LoRA rank; higher ranks add capacity and ``(in + out) * rank`` parameters per block.
        alpha: LoRA scaling numerator.

    Returns:
        ``model``, for chaining.

    Raises:
        TypeError: If a block's ``c_attn`` is not an ``nn.Linear`` (e.g. already adapted).
        ValueError: If ``rank`` is invalid for the projection shape.
    """
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.h:
        attn = block.attn
        if not isinstance(attn, CausalSelfAttention) or not isinstance(attn.c_attn, nn.Linear):
            raise TypeError("apply_lora expects un-adapted GPT-2 blocks with nn.Linear c_attn")
        attn.c_attn = LoRALinear(attn.c_attn, rank, alpha)
    return model


def gpt2(size: str) -> GPT2:
    """Build a GPT-2 model by size name.

    Args:
        size: One of ``"small"``, ``"medium"``, ``"large"``.

    Returns:
        The model, on the current default device.

    Raises:
        ValueError: If ``size`` is not a known size.
    """
    if size not in GPT2_CONFIGS:
        raise ValueError(f"unknown GPT-2 size {size!r}; choose from {sorted(GPT2_CONFIGS)}")
    return GPT2(GPT2_CONFIGS[size])
