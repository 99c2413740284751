"""Extra state objects (LR schedulers, a ``GradScaler``, an EMA model, a sampler's position):
their ``state_dict()`` as plain values and tensors, for the state stream (docs/state.md)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from chaos.errors import StateLayoutError
from chaos.replication.manifest import ENCODER, EXTRA_TAGS, ExtraEntry, TensorSpec, tensor_spec
from chaos.replication.staging import byte_view

__all__ = ["ExtraState", "decode_extra", "encode_extra", "extra_digest", "extra_tensor_count"]

ExtraState = dict[str, Any]
"""Extra state objects by name: each has ``state_dict()`` and ``load_state_dict(state)``."""


def encode_extra(
    extra: ExtraState | None,
) -> tuple[list[ExtraEntry], list[TensorSpec], list[torch.Tensor]]:
    """Every extra object's ``state_dict()`` as plain values, and its tensors, copied to CPU.

    The copies keep the bytes a donor serves fixed, whatever the object does meanwhile.

    Raises:
        TypeError: a value is neither a tensor of a supported dtype, a plain scalar, nor a
            dict, list or tuple of those (the message names the object and the path).
    """
    entries: list[ExtraEntry] = []
    specs: list[TensorSpec] = []
    tensors: list[torch.Tensor] = []

    def enc(v: Any, path: str) -> Any:
        if isinstance(v, torch.Tensor):
            t = v.detach().to("cpu", copy=True).contiguous()
            specs.append(tensor_spec(path, t))
            tensors.append(t)
            return ["X", len(tensors) - 1]
        if v is None or isinstance(v, (bool, str, bytes)):
            return v
        if isinstance(v, int):
            if not -(1 << 63) <= v < 1 << 64:
                raise TypeError(f"{path}: the int {v} does not fit in 64 bits")
            return int(v)
        if isinstance(v, float):
            return float(v)
        if isinstance(v, dict):
            return ["D", [[enc(k, f"{path}/<key>"), enc(x, f"{path}/{k}")] for k, x in v.items()]]
        if isinstance(v, (list, tuple)):
            tag = "L" if isinstance(v, list) else "T"
            return [tag, [enc(x, f"{path}/{i}") for i, x in enumerate(v)]]
        raise TypeError(
            f"extra state {path} is a {type(v).__name__}; a state_dict() may hold tensors, "
            "numbers, str, bytes, bool, None, and dicts, lists and tuples of those"
        )

    for name, obj in (extra or {}).items():
        getter = getattr(obj, "state_dict", None)
        if not callable(getter):
            raise TypeError(f"extra state {name!r} has no state_dict() method")
        entries.append(ExtraEntry(name=name, state=enc(getter(), name)))
    return entries, specs, tensors


def decode_extra(node: Any, tensors: Sequence[torch.Tensor], where: str) -> Any:
    """The value :func:`encode_extra` encoded as ``node``, with its tensors.

    Raises:
        StateLayoutError: ``node`` is not such an encoding.
    """
    if not isinstance(node, (list, tuple)):
        return node
    if len(node) != 2 or node[0] not in EXTRA_TAGS:
        raise StateLayoutError(f"malformed extra state at {where}")
    tag, body = node
    if tag == "X":
        if isinstance(body, bool) or not isinstance(body, int) or not 0 <= body < len(tensors):
            raise StateLayoutError(f"extra state at {where} names no tensor of the stream")
        return tensors[body]
    if not isinstance(body, (list, tuple)):
        raise StateLayoutError(f"malformed extra state at {where}")
    if tag == "D":
        out: dict[Any, Any] = {}
        for pair in body:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise StateLayoutError(f"malformed extra state dict at {where}")
            key = decode_extra(pair[0], tensors, where)
            if isinstance(key, (list, dict, torch.Tensor)):
                raise StateLayoutError(f"extra state at {where} has an unhashable key")
            out[key] = decode_extra(pair[1], tensors, f"{where}/{key}")
        return out
    items = [decode_extra(x, tensors, f"{where}/{i}") for i, x in enumerate(body)]
    return items if tag == "L" else tuple(items)


def extra_tensor_count(extra: ExtraState | None) -> int:
    """The tensors the extra objects' ``state_dict()`` hold now (to notice a new layout)."""
    count = 0

    def walk(v: Any) -> None:
        nonlocal count
        if isinstance(v, torch.Tensor):
            count += 1
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    for obj in (extra or {}).values():
        walk(obj.state_dict())
    return count


def extra_digest(extra: ExtraState | None) -> str:
    """SHA-256 (hex) of the extra objects' states: their encoded values and tensor bytes.

    Raises:
        TypeError: as :func:`encode_extra`.
    """
    entries, specs, tensors = encode_extra(extra)
    h = hashlib.sha256(ENCODER.encode([entries, specs]))
    for t in tensors:
        h.update(byte_view(t, "extra"))
    return h.hexdigest()
