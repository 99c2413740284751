"""The stand-in model an emulated device trains, in three kinds picked by the model name.

Its training state has the byte size of a paper model (:mod:`chaos.models`) times the run's
scale. The bulk of it is one buffer, ``store``, that takes no gradient, so the allreduce and the
compute stay small enough for 2 cores; a small MLP head trains for real (a real allreduce and a
real optimizer step every step). What the store holds decides what a content-addressed join
(``docs/state.md``, *What a joiner already holds*) finds already in place:

* ``frozen`` (``synthetic:N``): the store never changes. Each device initialises it from its own
  id, as a fresh random initialisation would, so a fresh joiner pulls all of it; a device that
  comes back with the state it had pulls only the head.
* ``full`` (every other model: ``resnet101``, ``gpt2-small``, ...): a full fine-tune. The store is
  initialised from the device's id and drifts every step: :meth:`StandInModel.drift` adds 1.0 to
  one element of every 256 KiB chunk of the stream (:data:`DRIFT_STRIDE_BYTES`), so every chunk's
  content address changes every step, as every tensor of a full fine-tune does. A returning
  device pulls nearly everything.
* ``lora`` (``gpt2-lora``): the store is the frozen base model, ``gpt2-small``'s weights, the same
  on every device (:data:`SHARED_BASE_SEED`: every device has the base checkpoint on disk), plus
  trainable adapters of ``gpt2-lora``'s size (its parameters, trained with AdamW: adapters and
  their AdamW state make ``gpt2-lora``'s state), initialised from the device's id. A device
  without the base on disk (``base_on_disk=False``) initialises the base from its id too.

The head is the same in every kind: SGD with momentum, except ``lora``, where one AdamW trains the
adapters and the head.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from enum import Enum

import torch

from chaos.models import model_summary

HEAD_IN = 32
HEAD_HIDDEN = 64
HEAD_OUT = 8
DRIFT_STRIDE_BYTES = 1 << 18
"""The stride of a full fine-tune's drift: the state stream's chunk size (``CHUNK_BYTES`` in
``chaos/replication/manifest.py``), so one element changes in every chunk of the store."""
SHARED_BASE_SEED = 1234
"""Seeds a LoRA base that every device holds (the base checkpoint on every device's disk)."""
LORA_MODEL = "gpt2-lora"
LORA_BASE_MODEL = "gpt2-small"
ADAPTER_INIT_STD = 0.01
ADAPTER_PENALTY = 1e-3
"""Weight of the adapters' term in the loss: it gives every adapter element a gradient."""
SYNTHETIC_PREFIX = "synthetic:"
_FP32 = 4


class StandInKind(str, Enum):
    """What a stand-in's store models: ``frozen`` (a state that does not change), ``full`` (a
    full fine-tune: every chunk changes every step), ``lora`` (a shared frozen base plus
    trainable adapters). A kind is fixed for a model; no transitions."""

    FROZEN = "frozen"
    FULL = "full"
    LORA = "lora"


def kind_for(model: str) -> StandInKind:
    """The stand-in kind of a model name: ``gpt2-lora`` is ``lora``, ``synthetic:N`` is
    ``frozen``, every other paper model is ``full``."""
    if model == LORA_MODEL:
        return StandInKind.LORA
    if model.startswith(SYNTHETIC_PREFIX):
        return StandInKind.FROZEN
    return StandInKind.FULL


def device_seed(device_id: str) -> int:
    """A seed drawn from a device's id (a fresh initialisation differs on every device)."""
    return int.from_bytes(hashlib.blake2b(device_id.encode(), digest_size=8).digest(), "little")


def head_params() -> int:
    """Parameters of the MLP head."""
    return HEAD_IN * HEAD_HIDDEN + HEAD_HIDDEN + HEAD_HIDDEN * HEAD_OUT + HEAD_OUT


def head_state_bytes() -> int:
    """Bytes of the head's parameters plus its SGD momentum buffers."""
    return 2 * _FP32 * head_params()


@dataclass(frozen=True)
class StandInConfig:
    """One device's stand-in model.

    Args:
        model: A :mod:`chaos.models` name; it picks the kind (:func:`kind_for`) and the sizes.
        scale: Shrinks the state (``0 < scale <= 1``, the run's ``--scale``).
        device_id: The device's node id: seeds what a fresh device initialises.
        base_on_disk: ``lora`` only: the device holds the shared base checkpoint (``False``:
            it initialises the base from its id, and a join pulls the base too).

    Raises:
        ValueError: an unknown model, a scale outside ``(0, 1]`` or an empty id.
        TypeError: ``base_on_disk`` is not a bool.
    """

    model: str
    scale: float
    device_id: str
    base_on_disk: bool = True

    def __post_init__(self) -> None:
        model_summary(self.model)  # raises ValueError on an unknown name
        if not isinstance(self.scale, (int, float)) or not math.isfinite(self.scale):
            raise ValueError(f"scale must be a finite number, got {self.scale!r}")
        if not 0 < self.scale <= 1:
            raise ValueError(f"scale must be in (0, 1], got {self.scale}")
        if not isinstance(self.device_id, str) or not self.device_id:
            raise ValueError(f"device_id must be a non-empty str, got {self.device_id!r}")
        if not isinstance(self.base_on_disk, bool):
            raise TypeError(f"base_on_disk must be a bool, got {self.base_on_disk!r}")

    @property
    def kind(self) -> StandInKind:
        """The stand-in kind of :attr:`model`."""
        return kind_for(self.model)

    def store_bytes(self) -> int:
        """The store's size: the LoRA base's weights, or what makes the whole state ``scale``
        times the model's state size."""
        if self.kind is StandInKind.LORA:
            return max(_FP32, int(model_summary(LORA_BASE_MODEL)["param_bytes"] * self.scale))
        target = int(model_summary(self.model)["state_bytes"] * self.scale)
        return max(_FP32, target - head_state_bytes())

    def adapter_elems(self) -> int:
        """Elements of the LoRA adapters (``0`` for the other kinds)."""
        if self.kind is not StandInKind.LORA:
            return 0
        return max(1, round(model_summary(LORA_MODEL)["params"] * self.scale))

    def store_seed(self) -> int:
        """The store's seed: shared for a LoRA base on disk, else the device's."""
        if self.kind is StandInKind.LORA and self.base_on_disk:
            return SHARED_BASE_SEED
        return device_seed(self.device_id)


class StandInModel(torch.nn.Module):
    """A store of :meth:`StandInConfig.store_bytes`, LoRA adapters where the kind has them, and
    a small trainable head.

    Args:
        config: What to build.
    """

    store: torch.Tensor

    def __init__(self, config: StandInConfig) -> None:
        super().__init__()
        self.config = config
        elems = config.store_bytes() // _FP32
        gen = torch.Generator().manual_seed(config.store_seed())
        self.register_buffer("store", torch.rand(elems, generator=gen))
        self.adapters: torch.nn.Parameter | None = None
        if config.adapter_elems():
            own = torch.Generator().manual_seed(device_seed(config.device_id))
            init = torch.randn(config.adapter_elems(), generator=own) * ADAPTER_INIT_STD
            self.adapters = torch.nn.Parameter(init)
        self.head = torch.nn.Sequential(
            torch.nn.Linear(HEAD_IN, HEAD_HIDDEN),
            torch.nn.ReLU(),
            torch.nn.Linear(HEAD_HIDDEN, HEAD_OUT),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(x)
        return out

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The training loss: cross-entropy of the head, plus a small penalty on the adapters
        that gives every adapter element a gradient."""
        loss = torch.nn.functional.cross_entropy(self(x), y)
        if self.adapters is not None:
            loss = loss + ADAPTER_PENALTY * self.adapters.square().mean()
        return loss

    def optimizer(self) -> torch.optim.Optimizer:
        """The kind's optimizer: AdamW over the adapters and the head (``lora``), else SGD with
        momentum over the head."""
        if self.adapters is not None:
            return torch.optim.AdamW([self.adapters, *self.head.parameters()], lr=1e-3)
        return torch.optim.SGD(self.head.parameters(), lr=0.01, momentum=0.9)

    def drift(self) -> None:
        """A full fine-tune's step of the store: adds 1.0 to one element of every
        :data:`DRIFT_STRIDE_BYTES` chunk (deterministic: every member does the same). Nothing
        for the other kinds. Call it after the optimizer step (``Trainer.update``'s
        ``after_step``), before the state can be served."""
        if self.config.kind is StandInKind.FULL:
            with torch.no_grad():
                self.store[:: DRIFT_STRIDE_BYTES // _FP32] += 1.0

    def drifting(self) -> torch.Tensor:
        """The store elements :meth:`drift` changes (empty for the other kinds)."""
        if self.config.kind is not StandInKind.FULL:
            return self.store[:0]
        return self.store[:: DRIFT_STRIDE_BYTES // _FP32]


def state_digest(model: StandInModel, opt: torch.optim.Optimizer) -> str:
    """SHA-256 of the part that trains: every optimized parameter and its optimizer state
    tensors, and the store elements a full fine-tune's drift changes."""
    h = hashlib.sha256()
    for group in opt.param_groups:
        for p in group["params"]:
            h.update(p.detach().numpy().tobytes())
            state = opt.state.get(p, {})
            for key in sorted(state):
                if isinstance(state[key], torch.Tensor):
                    h.update(state[key].numpy().tobytes())
    h.update(model.drifting().numpy().tobytes())
    return h.hexdigest()[:32]


__all__ = [
    "DRIFT_STRIDE_BYTES",
    "StandInConfig",
    "StandInKind",
    "StandInModel",
    "device_seed",
    "head_state_bytes",
    "kind_for",
    "state_digest",
]
