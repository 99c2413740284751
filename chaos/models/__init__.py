"""Training-state tensor sizes of the models of the Chaos paper.

Chaos replicates a model's full *training state* (what a node must hold to resume training) and
shards it between peers. The shard-assignment benchmark only needs the byte size of each tensor
of that state, in a fixed order. This package derives those lists from architecture definitions
written in this project (:mod:`chaos.models.vision`, :mod:`chaos.models.gpt2`), instantiated on
torch's ``meta`` device so that no memory is allocated and no weights are downloaded.

Models (all fp32, 4 bytes per element):

* ``resnet101``, ``alexnet``, ``vgg11``: CIFAR-10 classifiers (10-class heads) trained with SGD
  with momentum. State = parameters + buffers (batch-norm ``running_mean``/``running_var`` in
  fp32 and ``num_batches_tracked`` in int64, 8 bytes) + one momentum buffer per parameter.
  The paper quotes 178-528 MiB for these models, which is close to their weights alone (with a
  1000-class head); the figures here include the momentum buffers and are about twice that.
* ``gpt2-small``, ``gpt2-medium``, ``gpt2-large``: GPT-2 with a tied LM head (counted once),
  trained with AdamW. State = parameters + ``exp_avg`` + ``exp_avg_sq`` per parameter + a
  scalar ``step`` per parameter tensor. The paper quotes 468-3050 MiB, which matches the
  weights only; the figures here include the Adam state and are about three times that.
* ``gpt2-lora``: a rank-8 LoRA adapter on the fused qkv projection (``c_attn``) of every block
  of GPT-2 small. Only the adapter is trained and replicated, so the state is the ``lora_A`` /
  ``lora_B`` tensors plus their AdamW state (the frozen base model is not part of it). Note
  that 12 blocks x (8 x 768 + 2304 x 8) = 294,912 parameters = 1.125 MiB of weights, while the
  paper quotes 1.7 MiB.
* ``synthetic:N``: ``N`` MiB (``N`` may be fractional, ``0 < N <= 2**20``) of state with no
  model behind it. The total is ``round(N * 2**20 / 4) * 4`` bytes (whole fp32 elements), so an
  integer ``N`` gives exactly ``N * 2**20`` bytes. It is split like a stack of 1024x1024 linear
  layers: repeated pairs of a 4 MiB weight and a 4 KiB bias, then one remainder tensor with
  whatever is left (if any). For example ``synthetic:64`` is 15 pairs plus a 4,132,864-byte
  tensor. It has no optimizer: the listed tensors *are* the state.

Canonical order of a state list: trainable parameters in module order (``named_parameters``,
tied weights once), then buffers in module order (``named_buffers``), then optimizer state in
parameter order. For SGD that is one momentum buffer per parameter. For AdamW it is, per
parameter, ``exp_avg``, ``exp_avg_sq`` and then ``step``. ``step`` is counted as 4 bytes: a
float32 scalar tensor, which is what ``torch.optim.AdamW`` stores by default
(``capturable=False``, ``fused=False``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

import torch
from torch import nn

from chaos.models.gpt2 import apply_lora, gpt2
from chaos.models.vision import alexnet, resnet101, vgg11

__all__ = ["ADAM_STEP_BYTES", "MODEL_NAMES", "ModelSummary", "model_summary", "state_tensor_sizes"]

MODEL_NAMES: tuple[str, ...] = (
    "resnet101",
    "alexnet",
    "vgg11",
    "gpt2-small",
    "gpt2-medium",
    "gpt2-large",
    "gpt2-lora",
)
"""Names of the paper's models; ``"synthetic:N"`` is accepted in addition."""

ADAM_STEP_BYTES = 4
"""Bytes counted for AdamW's per-parameter ``step`` scalar (torch's default float32 tensor)."""

SYNTHETIC_PREFIX = "synthetic:"
SYNTHETIC_MAX_MIB = float(2**20)
_SYNTH_WEIGHT_BYTES = 4 * 2**20
_SYNTH_BIAS_BYTES = 4 * 2**10
_LORA_RANK = 8
_CIFAR10_CLASSES = 10


class ModelSummary(TypedDict):
    """What :func:`model_summary` returns (a plain ``dict`` at run time)."""

    name: str
    params: int
    param_bytes: int
    state_bytes: int
    tensors: int
    optimizer: str


@dataclass(frozen=True)
class _Spec:
    """How to build one named model and which optimizer trains it."""

    build: Callable[[], nn.Module]
    optimizer: str


_SPECS: dict[str, _Spec] = {
    "resnet101": _Spec(lambda: resnet101(_CIFAR10_CLASSES), "sgd-momentum"),
    "alexnet": _Spec(lambda: alexnet(_CIFAR10_CLASSES), "sgd-momentum"),
    "vgg11": _Spec(lambda: vgg11(_CIFAR10_CLASSES), "sgd-momentum"),
    "gpt2-small": _Spec(lambda: gpt2("small"), "adamw"),
    "gpt2-medium": _Spec(lambda: gpt2("medium"), "adamw"),
    "gpt2-large": _Spec(lambda: gpt2("large"), "adamw"),
    "gpt2-lora": _Spec(lambda: apply_lora(gpt2("small"), rank=_LORA_RANK), "adamw"),
}
if tuple(_SPECS) != MODEL_NAMES:  # pragma: no cover - guards edits to the two tables
    raise RuntimeError("chaos.models: _SPECS and MODEL_NAMES are out of sync")


@dataclass(frozen=True)
class _State:
    """Cached result for one name: the state list and the figures of its summary."""

    sizes: tuple[int, ...]
    params: int
    param_bytes: int
    optimizer: str


def _nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s storage as a dense tensor (works on ``meta`` tensors)."""
    return t.numel() * t.element_size()


def _model_state(spec: _Spec) -> _State:
    """Build ``spec``'s model on the meta device and list its training-state tensor sizes.

    Raises:
        ValueError: If the optimizer named by ``spec`` is not known.
    """
    with torch.device("meta"):
        model = spec.build()
    params = [p for p in model.parameters() if p.requires_grad]
    param_sizes = [_nbytes(p) for p in params]
    buffer_sizes = [_nbytes(b) for b in model.buffers()]
    if spec.optimizer == "sgd-momentum":
        opt_sizes = list(param_sizes)
    elif spec.optimizer == "adamw":
        opt_sizes = [n for size in param_sizes for n in (size, size, ADAM_STEP_BYTES)]
    else:
        raise ValueError(f"unknown optimizer {spec.optimizer!r}")
    return _State(
        sizes=tuple(param_sizes + buffer_sizes + opt_sizes),
        params=sum(p.numel() for p in params),
        param_bytes=sum(param_sizes),
        optimizer=spec.optimizer,
    )


def _synthetic_state(name: str) -> _State:
    """Split ``synthetic:N`` (N in MiB) into the deterministic layer-like mix (module docs).

    Raises:
        ValueError: If ``N`` is not a finite number in ``(0, SYNTHETIC_MAX_MIB]`` or rounds to
            zero bytes.
    """
    text = name[len(SYNTHETIC_PREFIX) :]
    try:
        mib = float(text)
    except ValueError:
        raise ValueError(
            f"bad synthetic size {text!r} in {name!r}: expected a number of MiB"
        ) from None
    if not math.isfinite(mib) or not 0 < mib <= SYNTHETIC_MAX_MIB:
        raise ValueError(
            f"synthetic size must be a finite number of MiB in (0, {SYNTHETIC_MAX_MIB:g}], "
            f"got {text!r}"
        )
    total = round(mib * 2**20 / 4) * 4
    if total <= 0:
        raise ValueError(f"synthetic size {text!r} MiB is less than one fp32 element")
    pair = _SYNTH_WEIGHT_BYTES + _SYNTH_BIAS_BYTES
    n_pairs, rest = divmod(total, pair)
    sizes = [_SYNTH_WEIGHT_BYTES, _SYNTH_BIAS_BYTES] * n_pairs
    if rest:
        sizes.append(rest)
    return _State(sizes=tuple(sizes), params=total // 4, param_bytes=total, optimizer="none")


@functools.lru_cache(maxsize=64)
def _state(name: str) -> _State:
    """Compute (once per name) the state of ``name``; see :func:`state_tensor_sizes`.

    Raises:
        ValueError: If ``name`` is neither a model name nor a valid ``synthetic:N``.
    """
    if name.startswith(SYNTHETIC_PREFIX):
        return _synthetic_state(name)
    spec = _SPECS.get(name)
    if spec is None:
        choices = ", ".join(MODEL_NAMES)
        raise ValueError(f"unknown model {name!r}; choose from {choices}, or synthetic:N (MiB)")
    return _model_state(spec)


def _lookup(name: str) -> _State:
    """Type-check ``name`` and return its cached state.

    Raises:
        TypeError: If ``name`` is not a ``str``.
        ValueError: If ``name`` is not a known model or a valid ``synthetic:N``.
    """
    if not isinstance(name, str):
        raise TypeError(f"model name must be a str, got {type(name).__name__}")
    return _state(name)


def state_tensor_sizes(name: str) -> list[int]:
    """Byte size of every tensor of a model's training state, in canonical order.

    The order is: trainable parameters in module order, then buffers, then optimizer state in
    parameter order (see the module docstring). Results are cached per name; each call returns
    a fresh list, so callers may modify it.

    Args:
        name: One of :data:`MODEL_NAMES`, or ``"synthetic:N"`` with ``N`` in MiB.

    Returns:
        The size in bytes of each tensor; their sum is the ``state_bytes`` of
        :func:`model_summary`.

    Raises:
        TypeError: If ``name`` is not a ``str``.
        ValueError: If ``name`` is not a known model (the message lists the valid names) or
            ``synthetic:N`` has a bad ``N``.
    """
    return list(_lookup(name).sizes)


def model_summary(name: str) -> ModelSummary:
    """Summarise a model's training state.

    Args:
        name: One of :data:`MODEL_NAMES`, or ``"synthetic:N"`` with ``N`` in MiB.

    Returns:
        A dict with ``name``; ``params``, the number of trained parameters (for ``gpt2-lora``
        only the adapter; for ``synthetic:N`` the state's fp32 element count); ``param_bytes``,
        their bytes; ``state_bytes``, the bytes of the whole training state; ``tensors``, the
        number of tensors in it; and ``optimizer`` (``"sgd-momentum"``, ``"adamw"`` or
        ``"none"``).

    Raises:
        TypeError: If ``name`` is not a ``str``.
        ValueError: If ``name`` is not a known model or ``synthetic:N`` has a bad ``N``.
    """
    state = _lookup(name)
    return {
        "name": name,
        "params": state.params,
        "param_bytes": state.param_bytes,
        "state_bytes": sum(state.sizes),
        "tensors": len(state.sizes),
        "optimizer": state.optimizer,
    }
