"""The runtime record that ends the state stream: step, epoch, user hyperparameters and the RNG
states (docs/state.md), and the plain values the state's header may carry."""

from __future__ import annotations

import random
from typing import Annotated, Any

import msgspec
import numpy as np
import torch

from chaos.errors import StateLayoutError

__all__ = [
    "RUNTIME_DECODER",
    "NumpyRandomState",
    "PyRandomState",
    "RuntimeInfo",
    "capture_runtime",
    "check_plain",
    "restore_rng",
    "to_tuples",
]


class PyRandomState(msgspec.Struct, array_like=True, frozen=True):
    """Python's ``random.getstate()``: ``(version, internal state, gauss_next)``."""

    version: int
    internal: list[int]
    gauss_next: float | None


class NumpyRandomState(msgspec.Struct, array_like=True, frozen=True):
    """numpy's legacy global ``np.random.get_state()``; ``keys`` is the raw uint32 array."""

    algorithm: str
    keys: bytes
    pos: int
    has_gauss: int
    cached_gaussian: float


class RuntimeInfo(msgspec.Struct, kw_only=True, frozen=True):
    """Runtime information carried at the end of the stream.

    Attributes:
        step: Global training step.
        epoch: Membership epoch the state belongs to.
        hyperparameters: User hyperparameters (plain msgpack types: str keys; ints, floats,
            strings, bools, None, lists and dicts of those).
        torch_rng: ``torch.get_rng_state()`` bytes (CPU generator).
        python_rng: ``random.getstate()``.
        numpy_rng: numpy's global RNG state.
    """

    step: Annotated[int, msgspec.Meta(ge=0)]
    epoch: Annotated[int, msgspec.Meta(ge=0)]
    hyperparameters: dict[str, Any] = {}
    torch_rng: bytes
    python_rng: PyRandomState
    numpy_rng: NumpyRandomState


RUNTIME_DECODER = msgspec.msgpack.Decoder(RuntimeInfo)


def capture_runtime(
    step: int, epoch: int, hyperparameters: dict[str, Any] | None = None
) -> RuntimeInfo:
    """Captures the current RNG states together with ``step``, ``epoch`` and hyperparameters.

    Args:
        step: Global training step (>= 0).
        epoch: Membership epoch (>= 0).
        hyperparameters: User hyperparameters, plain types only.

    Returns:
        The runtime record.

    Raises:
        ValueError: a negative step or epoch.
        TypeError: a hyperparameter is not a plain msgpack type.
    """
    for label, value in (("step", step), ("epoch", epoch)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{label} must be an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{label} must be >= 0, got {value}")
    hyper = dict(hyperparameters or {})
    check_plain(hyper, "hyperparameters")
    version, internal, gauss = random.getstate()
    algorithm, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    return RuntimeInfo(
        step=step,
        epoch=epoch,
        hyperparameters=hyper,
        torch_rng=torch.get_rng_state().numpy().tobytes(),
        python_rng=PyRandomState(version=version, internal=list(internal), gauss_next=gauss),
        numpy_rng=NumpyRandomState(
            algorithm=str(algorithm),
            keys=np.ascontiguousarray(keys, dtype=np.uint32).tobytes(),
            pos=int(pos),
            has_gauss=int(has_gauss),
            cached_gaussian=float(cached),
        ),
    )


def restore_rng(info: RuntimeInfo) -> None:
    """Sets the torch CPU, Python and numpy RNG states from ``info``.

    Raises:
        StateLayoutError: a state is malformed (wrong length, wrong algorithm); the RNGs are
            left as they were.
    """
    try:
        torch_state = torch.frombuffer(bytearray(info.torch_rng), dtype=torch.uint8)
        py_state = (
            info.python_rng.version,
            tuple(info.python_rng.internal),
            info.python_rng.gauss_next,
        )
        if len(info.numpy_rng.keys) != 624 * 4:  # MT19937: 624 32-bit words
            raise ValueError(f"numpy RNG key is {len(info.numpy_rng.keys)} bytes, expected 2496")
        np_keys = np.frombuffer(info.numpy_rng.keys, dtype=np.uint32)
        np_state = (
            info.numpy_rng.algorithm,
            np_keys,
            info.numpy_rng.pos,
            info.numpy_rng.has_gauss,
            info.numpy_rng.cached_gaussian,
        )
        if torch_state.numel() != torch.get_rng_state().numel():
            raise ValueError(f"torch RNG state has {torch_state.numel()} bytes")
        saved = (torch.get_rng_state(), random.getstate(), np.random.get_state(legacy=True))
        try:
            random.setstate(py_state)
            np.random.set_state(np_state)
            torch.set_rng_state(torch_state)
        except BaseException:
            torch.set_rng_state(saved[0])
            random.setstate(saved[1])
            np.random.set_state(saved[2])
            raise
    except (ValueError, TypeError, RuntimeError, OverflowError, IndexError) as exc:
        raise StateLayoutError(f"malformed RNG state in the runtime record: {exc}") from exc


def check_plain(value: Any, where: str) -> None:
    """Raises TypeError unless ``value`` is made only of plain msgpack types."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{where} has a non-str key {k!r}")
            check_plain(item, f"{where}[{k!r}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__name__}; only plain values (numbers, str, bytes, bool, None, "
        "lists and dicts of those) can travel in the state header"
    )


def to_tuples(value: Any) -> Any:
    """Lists back to tuples (msgpack has one array type; torch hyperparameters use tuples)."""
    if isinstance(value, list):
        return tuple(to_tuples(v) for v in value)
    return value
