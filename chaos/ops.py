"""Data-plane tensor ops: one facade over the native extension and its pure-torch fallback.

Other code imports only this module. Each op has a pure-torch implementation (the reference,
always available) and, where it wins, a native one from :mod:`chaos._native` (a torch C++
extension JIT-built on first use). Both give equal results: bitwise for :func:`pack`,
:func:`unpack`, :func:`checksum` and :func:`reduce_into`.

Which ops dispatch to native is decided by ``chaos-bench native`` (see :data:`NATIVE_OPS` and
``docs/native.md``); an op whose native version does not beat torch stays on torch.

Checksum design (computed identically by :func:`_checksum_torch` and ``native/ops.cpp``):

* the bytes are cut into 8-byte blocks ``j = 0 .. nb-1``, read little-endian; a last partial
  block is padded with zero bytes;
* ``lo_j`` and ``hi_j`` are the low and high 32 bits of block ``j``; its weight is
  ``W_j = (j mod 2**31) + 1`` (so ``1 <= W_j <= 2**31``);
* with the prime ``P = 2**32 - 5``: ``A = (n_bytes + sum_j W_j * lo_j) mod P`` and
  ``B = (sum_j W_j * hi_j) mod P``;
* the checksum is ``A * 2**32 + B`` (an int in ``[0, 2**64)``); zero bytes give ``0``.

Guarantees: every single-bit flip changes the checksum (the change is ``W_j * 2**k`` mod a prime
larger than both factors). Swapping two distinct 8-byte blocks ``a != b`` changes it unless
``a = b (mod 2**31)`` (blocks 16 GiB apart) or both 32-bit halves differ by exactly ``P``
(values ``x`` and ``x + P`` with ``x < 5``). It is an error-detecting code, not a cryptographic
hash. All arithmetic is exact int64: products stay below ``2**63``.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = [
    "NATIVE_CUDA_OPS",
    "NATIVE_OPS",
    "checksum",
    "native_available",
    "native_enabled",
    "pack",
    "reduce_into",
    "unpack",
    "use_native",
]

#: The prime modulus of the checksum's two sums.
CHECKSUM_PRIME = (1 << 32) - 5
#: Blocks per row in the vectorized checksum; must divide ``2**31``.
_CHECKSUM_ROW = 1 << 15
#: Rows processed per torch pass; bounds the fallback's temporary memory (about 16 MiB of data).
_CHECKSUM_ROWS_PER_PASS = 64

_ACC_DTYPES = (torch.float32, torch.float64)
_SRC_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

#: Ops that dispatch to native (CPU) when the extension is available, keyed as in
#: ``chaos-bench native``; ``reduce_into`` is keyed by its src dtype (a float64 acc always uses
#: torch). Rule: an op is ``True`` only if its median ratio fallback_s / native_s over three runs
#: is above 1.1 at every size (1.1, not 1: the machine's run-to-run noise). Measured ratios,
#: median of 3 runs of ``chaos-bench native --repeats 21`` on a shared, loaded 2-core VM,
#: 1MB / 16MB / 64MB (full table and method in docs/native.md):
NATIVE_OPS: dict[str, bool] = {
    "reduce_into_fp32": True,  # 111 (noise-inflated; 2.2 single-threaded) / 7.4 / 4.5
    "reduce_into_fp16": True,  # 1.2 / 7.8 / 5.1
    "reduce_into_bf16": True,  # 102 (noise-inflated; 2.1 single-threaded) / 8.8 / 4.5
    "pack": False,  # 1.74 / 1.27 / 1.04: a tie with torch.cat at 64 MB (0.98 single-threaded)
    "unpack": True,  # 3.1 / 1.17 / 1.85
    "checksum": True,  # 14.6 / 6.7 / 4.3
}

#: CUDA tensors: never measured (no GPU here), so every op stays on torch; the kernels in
#: ``native/cuda`` are only compiled by ``nvcc`` as a check. Enable an op here only after
#: ``chaos-bench native`` on a GPU shows that it wins.
NATIVE_CUDA_OPS: dict[str, bool] = {
    "reduce_into_fp32": False,
    "reduce_into_fp16": False,
    "reduce_into_bf16": False,
    "checksum": False,
}

_SRC_KEYS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

_state_lock = threading.Lock()
_native_enabled = True
_ignore_table = False
_native_module: Any = None
_native_tried = False


# --------------------------------------------------------------------------------------------
# native dispatch


def native_available() -> bool:
    """Whether the native extension is built (JIT-building it on the first call) and loadable.

    Returns:
        True when :mod:`chaos._native` could be loaded; False (after one warning) when the
        compiler or ninja is missing or the build failed.
    """
    return _load_native() is not None


def native_enabled() -> bool:
    """Whether native dispatch is currently switched on (see :func:`use_native`)."""
    return _native_enabled


@contextlib.contextmanager
def use_native(enabled: bool, *, all_ops: bool = False) -> Iterator[None]:
    """Switch native dispatch on or off for the duration of a ``with`` block.

    Process-wide (not per thread); tests and ``chaos-bench native`` use it to force one side.

    Args:
        enabled: False forces the pure-torch fallback; True allows native per :data:`NATIVE_OPS`.
        all_ops: With ``enabled``, use native for every CPU op, ignoring :data:`NATIVE_OPS`
            (to test and benchmark ops that are not kept native).

    Raises:
        TypeError: If ``enabled`` or ``all_ops`` is not a bool.
    """
    global _native_enabled, _ignore_table
    if not isinstance(enabled, bool) or not isinstance(all_ops, bool):
        raise TypeError("use_native(enabled, all_ops=...) takes bools")
    with _state_lock:
        previous = (_native_enabled, _ignore_table)
        _native_enabled, _ignore_table = enabled, all_ops
    try:
        yield
    finally:
        with _state_lock:
            _native_enabled, _ignore_table = previous


def _load_native() -> Any:
    global _native_module, _native_tried
    if _native_tried:
        return _native_module
    with _state_lock:
        if not _native_tried:
            try:
                from chaos._native import load

                _native_module = load()
            except ImportError as exc:  # the loader package itself is missing
                warnings.warn(
                    f"chaos native ops unavailable ({exc}); using the torch fallback",
                    RuntimeWarning,
                    stacklevel=3,
                )
                _native_module = None
            _native_tried = True
    return _native_module


def _native_for(op: str, *tensors: torch.Tensor) -> Any:
    """The native module if ``op`` should run natively on these tensors, else None."""
    if not _native_enabled:
        return None
    devices = {t.device.type for t in tensors}
    if devices == {"cpu"}:
        return _load_native() if (_ignore_table or NATIVE_OPS.get(op, False)) else None
    if devices == {"cuda"} and NATIVE_CUDA_OPS.get(op, False):
        from chaos._native import load_cuda

        return load_cuda()
    return None


# --------------------------------------------------------------------------------------------
# reduce_into


def reduce_into(acc: torch.Tensor, src: torch.Tensor, scale: float = 1.0) -> None:
    """Fused ``acc += src.to(acc.dtype) * scale``, in place.

    The product is rounded to ``acc.dtype`` before the add (no fused multiply-add), so native
    and fallback agree bitwise. With ``scale == 1.0`` it is a plain add.

    Args:
        acc: The accumulator: float32 or float64, contiguous, same shape (numel) as ``src``.
        src: The values to add: float32, float16 or bfloat16 (the wire formats), or float64.
            Non-contiguous ``src`` is accepted (copied to contiguous first).
        scale: Multiplier applied to ``src`` (e.g. ``1 / world_size`` to average).

    Raises:
        TypeError: If either argument is not a tensor, or a dtype is unsupported.
        ValueError: If the sizes differ, ``acc`` is not contiguous, or the devices differ.
    """
    if not isinstance(acc, torch.Tensor) or not isinstance(src, torch.Tensor):
        raise TypeError("reduce_into(acc, src) takes two tensors")
    if acc.dtype not in _ACC_DTYPES:
        raise TypeError(f"reduce_into: acc must be float32 or float64, got {acc.dtype}")
    if src.dtype not in _SRC_DTYPES:
        raise TypeError(
            f"reduce_into: src must be float32, float16, bfloat16 or float64, got {src.dtype}"
        )
    if src.dtype == torch.float64 and acc.dtype != torch.float64:
        raise TypeError("reduce_into: float64 src needs a float64 acc")
    if acc.numel() != src.numel():
        raise ValueError(f"reduce_into: size mismatch, acc has {acc.numel()}, src {src.numel()}")
    if not acc.is_contiguous():
        raise ValueError("reduce_into: acc must be contiguous (it is written in place)")
    if acc.device != src.device:
        raise ValueError(f"reduce_into: acc on {acc.device}, src on {src.device}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"reduce_into: scale must be a float, got {type(scale).__name__}")
    if acc.numel() == 0:
        return
    src = src.contiguous()
    key = _SRC_KEYS.get(src.dtype, "fp64") if acc.dtype == torch.float32 else "fp64"
    native = _native_for(f"reduce_into_{key}", acc, src)
    with torch.no_grad():
        if native is not None:
            native.reduce_into(acc.view(-1), src.view(-1), float(scale))
        else:
            _reduce_into_torch(acc.view(-1), src.view(-1), float(scale))


def _reduce_into_torch(acc: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    if scale == 1.0:
        acc.add_(src)  # mixed dtypes: src converts exactly, then one rounding (the add)
        return
    tmp = src.to(acc.dtype)
    if tmp is src:  # same dtype: do not scale the caller's tensor
        tmp = src.mul(scale)
    else:
        tmp.mul_(scale)
    acc.add_(tmp)


# --------------------------------------------------------------------------------------------
# pack / unpack


def _check_list(tensors: Sequence[torch.Tensor], what: str) -> None:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{what}: tensors must be a sequence of tensors")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: item {i} is a {type(t).__name__}, not a tensor")
    if tensors:
        dtype, device = tensors[0].dtype, tensors[0].device
        for i, t in enumerate(tensors):
            if t.dtype != dtype:
                raise ValueError(f"{what}: item {i} is {t.dtype}, item 0 is {dtype}")
            if t.device != device:
                raise ValueError(f"{what}: item {i} is on {t.device}, item 0 on {device}")


def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy a list of tensors, flattened in order, into one 1-D contiguous buffer.

    Args:
        tensors: Tensors of one dtype and device, any shapes (non-contiguous ones are fine).
        out: Optional destination: 1-D, contiguous, same dtype and device, with at least the
            total number of elements. Reuse one buffer across steps to avoid allocating.

    Returns:
        The packed buffer: ``out[:total]`` when ``out`` is given, else a new tensor. An empty
        ``tensors`` gives an empty buffer (float32 unless ``out`` says otherwise).

    Raises:
        TypeError: If ``tensors`` is not a sequence of tensors or ``out`` is not a tensor.
        ValueError: On mixed dtypes or devices, or an ``out`` of the wrong dtype, device,
            shape or size.
    """
    _check_list(tensors, "pack")
    total = sum(t.numel() for t in tensors)
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"pack: out must be a tensor, got {type(out).__name__}")
        if out.dim() != 1 or not out.is_contiguous():
            raise ValueError("pack: out must be a 1-D contiguous tensor")
        if tensors and (out.dtype != tensors[0].dtype or out.device != tensors[0].device):
            raise ValueError(
                f"pack: out is {out.dtype} on {out.device}, tensors are "
                f"{tensors[0].dtype} on {tensors[0].device}"
            )
        if out.numel() < total:
            raise ValueError(f"pack: out holds {out.numel()} elements, {total} needed")
        dest = out[:total]
    elif tensors:
        dest = torch.empty(total, dtype=tensors[0].dtype, device=tensors[0].device)
    else:
        return torch.empty(0)
    if total == 0:
        return dest
    with torch.no_grad():
        native = _native_for("pack", dest, *tensors)
        if native is not None:
            native.pack([t.contiguous() for t in tensors], dest)
        else:
            torch.cat([t.reshape(-1) for t in tensors], out=dest)
    return dest


def unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy a packed buffer back into the tensors it was packed from, in place.

    Args:
        flat: 1-D buffer as made by :func:`pack`, same dtype and device, numel equal to the
            total numel of ``tensors``.
        tensors: Destinations, written in place (non-contiguous ones are fine).

    Raises:
        TypeError: If the arguments are not tensors.
        ValueError: On mixed dtypes or devices, or a ``flat`` of the wrong dtype, shape or size.
    """
    if not isinstance(flat, torch.Tensor):
        raise TypeError(f"unpack: flat must be a tensor, got {type(flat).__name__}")
    _check_list(tensors, "unpack")
    total = sum(t.numel() for t in tensors)
    if flat.dim() != 1:
        raise ValueError(f"unpack: flat must be 1-D, got shape {tuple(flat.shape)}")
    if flat.numel() != total:
        raise ValueError(f"unpack: flat has {flat.numel()} elements, tensors need {total}")
    if tensors and (flat.dtype != tensors[0].dtype or flat.device != tensors[0].device):
        raise ValueError(
            f"unpack: flat is {flat.dtype} on {flat.device}, tensors are "
            f"{tensors[0].dtype} on {tensors[0].device}"
        )
    if total == 0:
        return
    flat = flat.contiguous()
    with torch.no_grad():
        native = _native_for("unpack", flat, *tensors)
        if native is not None and all(t.is_contiguous() for t in tensors):
            native.unpack(flat, list(tensors))
            return
        offset = 0
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view(t.shape))
            offset += n


# --------------------------------------------------------------------------------------------
# checksum


def _as_byte_tensor(data: torch.Tensor | bytes | bytearray | memoryview) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        t = data.detach().contiguous().reshape(-1)
        if t.numel() == 0:
            return torch.empty(0, dtype=torch.uint8)
        return t.view(torch.uint8)
    if isinstance(data, memoryview):
        buf: bytes | bytearray | memoryview = (
            data.cast("B") if data.c_contiguous else data.tobytes()
        )
    elif isinstance(data, (bytes, bytearray)):
        buf = data
    else:
        raise TypeError(
            f"checksum takes a tensor, bytes, bytearray or memoryview, got {type(data).__name__}"
        )
    if len(buf) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # read-only buffers: we never write through the view
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8)


def checksum(data: torch.Tensor | bytes | bytearray | memoryview) -> int:
    """A fast 64-bit checksum of raw bytes (see the module docstring for the exact definition).

    A tensor is checksummed as its elements' bytes in row-major order (native byte order,
    little-endian on every supported host), whatever its dtype, strides or device.

    Args:
        data: A tensor of any dtype, or a bytes-like object (any length, including 0).

    Returns:
        An int in ``[0, 2**64)``; ``0`` for empty data.

    Raises:
        TypeError: If ``data`` is not a tensor or bytes-like object.
    """
    u8 = _as_byte_tensor(data)
    if u8.numel() == 0:
        return 0
    native = _native_for("checksum", u8)
    if native is not None:
        return int(native.checksum(u8))
    return _checksum_torch(u8.cpu())


def _checksum_torch(u8: torch.Tensor) -> int:
    """Reference implementation of :func:`checksum` over a 1-D uint8 CPU tensor."""
    n = u8.numel()
    nfull = n // 8
    if u8.storage_offset() % 8 != 0:
        u8 = u8.clone()  # int64 views need an 8-byte-aligned offset
    a = n % CHECKSUM_PRIME
    b = 0
    if nfull:
        blocks = u8[: nfull * 8].view(torch.int64)
        a2, b2 = _checksum_blocks(blocks, 0)
        a, b = a + a2, b + b2
    if n % 8:
        tail = torch.zeros(8, dtype=torch.uint8)
        tail[: n % 8] = u8[nfull * 8 :]
        a2, b2 = _checksum_blocks(tail.view(torch.int64), nfull)
        a, b = a + a2, b + b2
    return (a % CHECKSUM_PRIME) << 32 | (b % CHECKSUM_PRIME)


def _checksum_blocks(blocks: torch.Tensor, first: int) -> tuple[int, int]:
    """``(sum W_j lo_j mod P, sum W_j hi_j mod P)`` over int64 blocks numbered from ``first``.

    ``first`` must be a multiple of the row size unless ``blocks`` fits in one row.
    """
    p, k = CHECKSUM_PRIME, _CHECKSUM_ROW
    nb = blocks.numel()
    nrows = nb // k
    sum_a = sum_b = 0
    t = torch.arange(k, dtype=torch.int64)
    step = _CHECKSUM_ROWS_PER_PASS
    for r0 in range(0, nrows, step):
        r1 = min(nrows, r0 + step)
        rows = blocks[r0 * k : r1 * k].view(r1 - r0, k)
        base = (torch.arange(r0, r1, dtype=torch.int64) * k + first) % (1 << 31) + 1
        for half in (0, 1):
            v = (rows >> 32) & 0xFFFFFFFF if half else rows & 0xFFFFFFFF
            s1 = v.sum(dim=1) % p  # each row sum < 2**47
            s2 = (v * t).sum(dim=1) % p  # t * v < 2**47, row sum < 2**62
            part = int(((base * s1 + s2) % p).sum())
            if half:
                sum_b += part
            else:
                sum_a += part
    rest = blocks[nrows * k :]
    if rest.numel():
        w = (torch.arange(rest.numel(), dtype=torch.int64) + nrows * k + first) % (1 << 31) + 1
        sum_a += int(((rest & 0xFFFFFFFF) * w % p).sum())
        sum_b += int((((rest >> 32) & 0xFFFFFFFF) * w % p).sum())
    return sum_a % p, sum_b % p
