"""The models and data of ``chaos-emulate train``: shipped with the code, nothing downloaded.

- ``gpt``: a small character-level GPT (:class:`chaos.models.gpt2.GPT2`, about 0.4 M
  parameters, context 64) on English-like text that :func:`make_text` generates from a seeded
  random grammar (a few hundred kB): the words, their agreement and the sentence shapes give a
  character-level loss real structure to learn, from about 3.4 nats (uniform over the
  characters) down to about 1.
- ``cnn``: a small convolutional network on scikit-learn's bundled digits, upsampled to 16x16,
  randomly shifted and noised (a harder task that takes a while to learn).

Every device reads its own stream of batches (:class:`Batches`, seeded by the run's seed and
the device's rank) from the training part; the evaluation batch (:func:`eval_batch`) is a fixed
held-out part, the same in every run.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from chaos.errors import ConfigError
from chaos.models.gpt2 import GPT2, GPT2Config

__all__ = [
    "MODELS",
    "Batches",
    "ModelSpec",
    "build_model",
    "eval_batch",
    "loss_of",
    "make_text",
]

TEXT_CHARS = 400_000
"""The generated text's length in characters."""
TEXT_SEED = 1234
"""The grammar's seed: the same text in every run."""
HELD_OUT = 0.1
"""The share of the data held out for evaluation (the text's last tenth, the digits' split)."""
BLOCK = 64
"""The GPT's context (characters per training sequence)."""
IMAGE = 16
"""The digits' side in pixels (the 8x8 originals upsampled)."""
SHIFT = 3
"""The digits' random shift, pixels each way."""
NOISE = 0.5
"""The standard deviation of the noise added to the digits (their pixels are in [0, 1])."""


@dataclass(frozen=True)
class ModelSpec:
    """One model of the benchmark and its defaults.

    Args:
        name: ``gpt`` or ``cnn``.
        batch: Samples per device per step (sequences of :data:`BLOCK` characters, or images).
        lr: The inner (or single/sync) AdamW learning rate.
        target_loss: The default target of the held-out loss.
        eval_samples: Samples in the fixed evaluation batch.
    """

    name: str
    batch: int
    lr: float
    target_loss: float
    eval_samples: int


MODELS: dict[str, ModelSpec] = {
    "gpt": ModelSpec("gpt", batch=16, lr=3e-3, target_loss=0.65, eval_samples=64),
    "cnn": ModelSpec("cnn", batch=64, lr=2e-3, target_loss=0.6, eval_samples=359),
}


# ----------------------------------------------------------------------------- the text

_NOUNS = ("cat", "dog", "bird", "farmer", "child", "teacher", "river", "house", "garden",
          "king", "queen", "horse", "tree", "ship", "city", "friend", "doctor", "window")
_ADJS = ("small", "old", "green", "quiet", "bright", "heavy", "little", "brave", "cold", "red")
_VERBS = ("sees", "likes", "follows", "finds", "watches", "helps", "carries", "calls", "knows")
_IVERBS = ("sleeps", "runs", "waits", "sings", "falls", "smiles", "works", "listens")
_PREPS = ("near", "under", "behind", "over", "beside", "inside")
_ADVS = ("slowly", "quietly", "often", "today", "again", "always")
_DETS = ("the", "a", "every", "one", "that")
_CONJ = ("and", "but", "because", "while", "so")


def _noun_phrase(rng: random.Random) -> str:
    words = [rng.choice(_DETS)]
    if rng.random() < 0.5:
        words.append(rng.choice(_ADJS))
    words.append(rng.choice(_NOUNS))
    if rng.random() < 0.2:
        words += [rng.choice(_PREPS), "the", rng.choice(_NOUNS)]
    return " ".join(words)


def _clause(rng: random.Random) -> str:
    subject = _noun_phrase(rng)
    if rng.random() < 0.6:
        clause = f"{subject} {rng.choice(_VERBS)} {_noun_phrase(rng)}"
    else:
        clause = f"{subject} {rng.choice(_IVERBS)}"
    if rng.random() < 0.3:
        clause += f" {rng.choice(_ADVS)}"
    return clause


def _sentence(rng: random.Random) -> str:
    s = _clause(rng)
    if rng.random() < 0.35:
        s += f" {rng.choice(_CONJ)} {_clause(rng)}"
    end = "?" if rng.random() < 0.1 else "."
    return s[0].upper() + s[1:] + end


def make_text(chars: int = TEXT_CHARS, seed: int = TEXT_SEED) -> str:
    """English-like text from a seeded random grammar (the same for the same arguments).

    Args:
        chars: Its length in characters (at least 1000).
        seed: The grammar's seed.

    Raises:
        ConfigError: ``chars`` under 1000.
    """
    if chars < 1000:
        raise ConfigError(f"the text needs at least 1000 characters, got {chars}")
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < chars:
        para = " ".join(_sentence(rng) for _ in range(rng.randint(2, 6))) + "\n"
        parts.append(para)
        size += len(para)
    return "".join(parts)[:chars]


# ----------------------------------------------------------------------------- the models


class DigitsCNN(nn.Module):
    """A small CNN for the 16x16 digits: three 3x3 convolutions, two poolings, two linear
    layers (about 0.1 M parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.conv3 = nn.Conv2d(32, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``(N, 10)`` of images ``(N, 1, 16, 16)``."""
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv3(F.relu(self.conv2(x)))), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


@dataclass(frozen=True)
class Dataset:
    """A model's data: the training and held-out parts.

    For ``gpt`` the inputs are the text's character ids (1-D) and ``labels`` is empty; for
    ``cnn`` they are images ``(n, 1, 8, 8)`` with their labels.
    """

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    vocab: int


def load_data(name: str) -> Dataset:
    """The data of model ``name`` (``gpt``: the generated text; ``cnn``: the digits).

    Raises:
        ConfigError: an unknown model.
        SystemExit: ``cnn`` without scikit-learn (the message says what to install).
    """
    if name == "gpt":
        text = make_text()
        chars = sorted(set(text))
        ids = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
        cut = int(len(ids) * (1 - HELD_OUT))
        empty = torch.empty(0, dtype=torch.long)
        return Dataset(ids[:cut], empty, ids[cut:], empty, len(chars))
    if name == "cnn":
        try:
            from sklearn.datasets import load_digits
        except ImportError as exc:
            raise SystemExit("the cnn model trains on scikit-learn's digits: "
                             "pip install 'chaos-edge[examples]'") from exc  # fmt: skip
        digits = load_digits()
        x = torch.tensor(digits.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
        x = F.interpolate(x, size=(IMAGE, IMAGE), mode="bilinear", align_corners=False)
        y = torch.tensor(digits.target, dtype=torch.long)
        gen = torch.Generator().manual_seed(0)
        order = torch.randperm(len(y), generator=gen)
        n_test = int(len(y) * 0.2)
        test, train = order[:n_test], order[n_test:]
        test_x = _augment(x[test], gen)  # a fixed noisy, shifted test split
        return Dataset(x[train], y[train], test_x, y[test], 10)
    raise ConfigError(f"unknown model {name!r}: expected one of {sorted(MODELS)}")


def _augment(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Images shifted by up to :data:`SHIFT` pixels each way, plus Gaussian noise
    (:data:`NOISE`): a harder task than the clean digits, so that it takes a while to learn."""
    n = x.shape[0]
    padded = F.pad(x, (SHIFT, SHIFT, SHIFT, SHIFT))
    dx = torch.randint(0, 2 * SHIFT + 1, (n,), generator=gen).tolist()
    dy = torch.randint(0, 2 * SHIFT + 1, (n,), generator=gen).tolist()
    out = torch.stack([padded[i, :, dy[i] : dy[i] + IMAGE, dx[i] : dx[i] + IMAGE]
                       for i in range(n)])  # fmt: skip
    return out + NOISE * torch.randn(out.shape, generator=gen)


def build_model(name: str, vocab: int, seed: int) -> nn.Module:
    """Model ``name``, initialised from ``seed`` (the same on every device of a run).

    Raises:
        ConfigError: an unknown model.
    """
    torch.manual_seed(seed)
    if name == "gpt":
        gpt = GPT2(GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=vocab, n_ctx=BLOCK))
        with torch.no_grad():  # GPT-2's own init of the embeddings (the tied head's too)
            nn.init.normal_(gpt.wte.weight, std=0.02)
            nn.init.normal_(gpt.wpe.weight, std=0.02)
        return gpt
    if name == "cnn":
        return DigitsCNN()
    raise ConfigError(f"unknown model {name!r}: expected one of {sorted(MODELS)}")


def loss_of(name: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of a batch (for ``gpt``: next-character over ``x``'s rows)."""
    if name == "gpt":
        logits = model(x[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    return F.cross_entropy(model(x), y)


class Batches:
    """One device's stream of training batches: seeded by the run's seed and its rank, so
    every device reads different samples (random offsets into the text, random images).

    Args:
        name: The model.
        data: Its data.
        batch: Samples per batch.
        seed: The run's seed.
        rank: The device's index.
    """

    def __init__(self, name: str, data: Dataset, batch: int, seed: int, rank: int) -> None:
        self.name, self.data, self.batch = name, data, batch
        self._gen = torch.Generator().manual_seed(seed * 1009 + rank)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch ``(x, y)`` (``y`` empty for ``gpt``)."""
        d = self.data
        if self.name == "gpt":
            span = len(d.train_x) - BLOCK - 1
            starts = torch.randint(0, span, (self.batch,), generator=self._gen)
            x = torch.stack([d.train_x[s : s + BLOCK + 1] for s in starts.tolist()])
            return x, d.train_y
        idx = torch.randint(0, len(d.train_y), (self.batch,), generator=self._gen)
        return _augment(d.train_x[idx], self._gen), d.train_y[idx]


def eval_batch(name: str, data: Dataset, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed held-out evaluation batch (the same in every run): for ``gpt``, ``samples``
    sequences evenly spaced over the held-out text; for ``cnn``, the first ``samples`` test
    images."""
    if name == "gpt":
        span = len(data.test_x) - BLOCK - 1
        starts = [i * span // samples for i in range(samples)]
        return torch.stack([data.test_x[s : s + BLOCK + 1] for s in starts]), data.test_y
    return data.test_x[:samples], data.test_y[:samples]
