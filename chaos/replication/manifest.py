"""The state stream's header: the layout of every tensor, which a joiner allocates from before
any shard arrives, and the one check of a received manifest (docs/state.md)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec
import torch

from chaos.errors import StateLayoutError
from chaos.wire import STATE_FORMAT_VERSION

__all__ = [
    "CHUNK_BYTES",
    "CHUNK_DIGEST_BYTES",
    "DTYPES",
    "ENCODER",
    "EXTRA_TAGS",
    "MAX_MANIFEST_BYTES",
    "MAX_RUNTIME_BYTES",
    "UNREADABLE",
    "ExtraEntry",
    "Manifest",
    "OptimTensorSpec",
    "OptimValue",
    "TensorSpec",
    "chunk_address",
    "chunk_ranges",
    "decode_manifest",
    "dtype_name",
    "element_sizes",
    "layout_fingerprint",
    "nbytes",
    "tensor_spec",
    "tensor_refs",
]

MAX_MANIFEST_BYTES = 64 << 20
"""Largest encoded manifest a joiner accepts (64 MiB: far above any real model's header)."""

CHUNK_BYTES = 1 << 18
"""Default chunk size of the content addresses (256 KiB): a joiner skips a chunk it already
holds, so smaller chunks skip more of a state that changed in places, at 16 bytes of manifest
per chunk."""

MIN_CHUNK_BYTES = 1 << 12
MAX_CHUNK_BYTES = 1 << 26

CHUNK_DIGEST_BYTES = 16
"""Length of a chunk's content address (SHA-256 cut to 128 bits)."""

MAX_RUNTIME_BYTES = 16 << 20
"""Largest runtime record a joiner accepts (16 MiB)."""

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}

Dim = Annotated[int, msgspec.Meta(ge=0)]
Index = Annotated[int, msgspec.Meta(ge=0)]
Name = Annotated[str, msgspec.Meta(max_length=1024)]


# ----------------------------------------------------------------------------- wire structs


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    """One tensor of the stream: its name, dtype name (``"float32"``) and shape."""

    name: Name
    dtype: str
    shape: list[Dim]


class OptimTensorSpec(msgspec.Struct, array_like=True, frozen=True):
    """One optimizer state tensor, ``optimizer.state[p][key]`` where ``p`` is
    ``param_groups[group]["params"][index]``."""

    group: Index
    index: Index
    key: Name
    dtype: str
    shape: list[Dim]


class OptimValue(msgspec.Struct, array_like=True, frozen=True):
    """One non-tensor optimizer state value (plain msgpack types only)."""

    group: Index
    index: Index
    key: Name
    value: Any


class ExtraEntry(msgspec.Struct, array_like=True, frozen=True):
    """One extra state object: its name and its ``state_dict()`` in the tagged plain encoding
    of :func:`chaos.replication.extra.encode_extra` (``["D", [[key, value], ...]]``,
    ``["L", [...]]``, ``["T", [...]]``, ``["X", i]`` for the ``i``-th tensor of
    ``Manifest.extra_tensors``; scalars as they are)."""

    name: Name
    state: Any


class Manifest(msgspec.Struct, kw_only=True, frozen=True):
    """The stream's header: everything a joiner needs to allocate before shards arrive.

    Attributes:
        version: :data:`STATE_FORMAT_VERSION`.
        fingerprint: :func:`layout_fingerprint` of the layout fields below.
        optimizer_class: ``module.QualName`` of the optimizer.
        params: Per param group, the dtype and shape of each parameter (name left empty).
        param_groups: Per param group, its hyperparameters (every key but ``"params"``).
        model: The model's tensors, in stream order.
        optim: The optimizer's tensors, in stream order.
        optim_values: The optimizer's non-tensor per-parameter values.
        extra: The extra state objects, in stream order: name and encoded ``state_dict()``.
        extra_tensors: Their tensors, in stream order (named ``OBJECT/PATH``).
        runtime_bytes: Length of the runtime record that ends the stream.
        runtime_digest: SHA-256 (hex) of the runtime record; :meth:`TrainingState.apply` checks
            the received record against it, and donors whose records differ have different
            manifests (so a joiner never assembles one record from two donors).
        total_bytes: Length of the whole stream.
        chunk_bytes: The chunk size of ``chunks``.
        chunks: The content address of every chunk of the stream, in stream order
            (:func:`chunk_ranges`: each element cut into ``chunk_bytes`` pieces, the last one
            shorter): SHA-256 of the chunk's bytes, cut to 128 bits. A joiner skips the chunks
            whose bytes it already holds (a base model on disk, a returning device's state).
    """

    version: int = STATE_FORMAT_VERSION
    fingerprint: str
    optimizer_class: str
    params: list[list[TensorSpec]]
    param_groups: list[dict[str, Any]]
    model: list[TensorSpec]
    optim: list[OptimTensorSpec]
    optim_values: list[OptimValue]
    extra: list[ExtraEntry] = []
    extra_tensors: list[TensorSpec] = []
    runtime_bytes: Annotated[int, msgspec.Meta(ge=0, le=MAX_RUNTIME_BYTES)]
    runtime_digest: Annotated[str, msgspec.Meta(max_length=64)]
    total_bytes: Annotated[int, msgspec.Meta(ge=0)]
    chunk_bytes: Annotated[int, msgspec.Meta(ge=MIN_CHUNK_BYTES, le=MAX_CHUNK_BYTES)] = CHUNK_BYTES
    chunks: list[Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]] = []


UNREADABLE = (msgspec.DecodeError, RecursionError, UnicodeDecodeError)
"""What msgspec raises on unreadable bytes (malformed, nested too deep, not UTF-8)."""
_MANIFEST_DECODER = msgspec.msgpack.Decoder(Manifest)
ENCODER = msgspec.msgpack.Encoder()
"""The one msgpack encoder of the state stream's records."""

EXTRA_TAGS = frozenset(("D", "L", "T", "X"))
"""The tags of the extra states' plain encoding (:func:`chaos.replication.extra.encode_extra`)."""


def dtype_name(t: torch.Tensor, where: str) -> str:
    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"{where}: dtype {t.dtype} is not supported in the state stream")
    return name


def nbytes(dtype: str, shape: Sequence[int]) -> int:
    return math.prod(shape) * torch.empty((), dtype=DTYPES[dtype]).element_size()


def tensor_spec(name: str, t: torch.Tensor) -> TensorSpec:
    return TensorSpec(name=name, dtype=dtype_name(t, name), shape=list(t.shape))


def tensor_refs(node: Any, refs: list[int]) -> None:
    """Appends to ``refs`` every tensor index an encoded value names (checked later)."""
    if isinstance(node, (list, tuple)) and len(node) == 2 and node[0] in EXTRA_TAGS:
        tag, body = node
        if tag == "X":
            refs.append(body if isinstance(body, int) and not isinstance(body, bool) else -1)
        elif isinstance(body, (list, tuple)):
            for item in body:
                if tag == "D" and isinstance(item, (list, tuple)):  # a [key, value] pair
                    for part in item:
                        tensor_refs(part, refs)
                else:
                    tensor_refs(item, refs)


def layout_fingerprint(
    model: Sequence[TensorSpec],
    optimizer_class: str,
    params: Sequence[Sequence[TensorSpec]],
    optim: Sequence[OptimTensorSpec],
    extra: Sequence[ExtraEntry] = (),
    extra_tensors: Sequence[TensorSpec] = (),
) -> str:
    """SHA-256 (hex) of the layout: names, dtypes and shapes of every tensor, the optimizer,
    and the names of the extra state objects.

    Two states with equal fingerprints have identical streams up to the runtime record.
    """
    canon = [
        "chaos-state",
        STATE_FORMAT_VERSION,
        [[s.name, s.dtype, s.shape] for s in model],
        optimizer_class,
        [[[p.dtype, p.shape] for p in group] for group in params],
        [[s.group, s.index, s.key, s.dtype, s.shape] for s in optim],
        [e.name for e in extra],
        [[s.name, s.dtype, s.shape] for s in extra_tensors],
    ]
    return hashlib.sha256(ENCODER.encode(canon)).hexdigest()


def decode_manifest(data: bytes | memoryview) -> Manifest:
    """Decodes and checks a manifest received from a donor.

    Raises:
        StateLayoutError: the bytes are oversized, malformed, of another format version, name an
            unsupported dtype, or are inconsistent (sizes, fingerprint, optimizer state or
            hyperparameters for params that the layout does not have).
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise StateLayoutError(f"manifest of {len(data)} bytes exceeds {MAX_MANIFEST_BYTES}")
    try:
        m = _MANIFEST_DECODER.decode(data)
    except UNREADABLE as exc:
        raise StateLayoutError(f"malformed state manifest: {exc}") from exc
    if m.version != STATE_FORMAT_VERSION:
        raise StateLayoutError(
            f"state format version {m.version}, this node speaks {STATE_FORMAT_VERSION}"
        )
    specs: list[TensorSpec | OptimTensorSpec] = [*m.model, *m.optim, *m.extra_tensors]
    specs += [p for group in m.params for p in group]
    for s in specs:
        if s.dtype not in DTYPES:
            raise StateLayoutError(f"manifest names an unsupported dtype {s.dtype!r}")
    sizes = element_sizes(m)
    total = sum(sizes)
    if total != m.total_bytes:
        raise StateLayoutError(f"manifest total_bytes {m.total_bytes} != its tensors' {total}")
    if len(m.chunks) != sum(-(-size // m.chunk_bytes) for size in sizes):  # never materialised
        raise StateLayoutError(f"manifest has {len(m.chunks)} chunk addresses for its layout")
    if len(m.param_groups) != len(m.params):
        raise StateLayoutError("manifest has a different number of param groups and param lists")
    owners = [(o.group, o.index) for o in m.optim]
    owners += [(v.group, v.index) for v in m.optim_values]  # the values are not fingerprinted
    for group, index in owners:
        if group >= len(m.params) or index >= len(m.params[group]):
            raise StateLayoutError(
                f"manifest names optimizer state of param {index} of group {group},"
                " which its layout does not have"
            )
    if any("params" in hyper for hyper in m.param_groups):
        raise StateLayoutError("manifest hyperparameters name 'params'")
    refs: list[int] = []
    for entry in m.extra:
        tensor_refs(entry.state, refs)
    if sorted(refs) != list(range(len(m.extra_tensors))):
        raise StateLayoutError("manifest extra state does not name each of its tensors once")
    if len({e.name for e in m.extra}) != len(m.extra):
        raise StateLayoutError("manifest names an extra state object twice")
    fingerprint = layout_fingerprint(
        m.model, m.optimizer_class, m.params, m.optim, m.extra, m.extra_tensors
    )
    if fingerprint != m.fingerprint:
        raise StateLayoutError("manifest fingerprint does not match its layout")
    return m


def element_sizes(m: Manifest) -> list[int]:
    """The bytes of every element of the stream ``m`` describes, in order, the runtime record
    last (what :meth:`TrainingState.tensor_sizes` returns)."""
    sizes = [nbytes(s.dtype, s.shape) for s in m.model]
    sizes += [nbytes(o.dtype, o.shape) for o in m.optim]
    sizes += [nbytes(s.dtype, s.shape) for s in m.extra_tensors]
    return [*sizes, m.runtime_bytes]


def chunk_ranges(sizes: Sequence[int], chunk_bytes: int) -> list[tuple[int, int]]:
    """The ``(offset, length)`` of every chunk of a stream whose elements have ``sizes``: each
    element is cut on its own into ``chunk_bytes`` pieces (the last one shorter), so a chunk
    never spans two tensors and one tensor's change leaves the others' addresses alone.

    Raises:
        ValueError: ``chunk_bytes`` is below 1.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be at least 1, got {chunk_bytes}")
    out: list[tuple[int, int]] = []
    start = 0
    for size in sizes:
        out.extend((start + o, min(chunk_bytes, size - o)) for o in range(0, size, chunk_bytes))
        start += size
    return out


def chunk_address(data: bytes | bytearray | memoryview) -> bytes:
    """A chunk's content address: SHA-256 cut to 128 bits (SHA-256 rather than BLAKE2b: with
    the CPUs' SHA extensions it is the faster of the two here)."""
    return hashlib.sha256(data).digest()[:CHUNK_DIGEST_BYTES]
