"""An allreduce call's argument checks and its result buffer (internal to
:mod:`chaos.collectives`; used by :meth:`Communicator.allreduce
<chaos.collectives.communicator.Communicator.allreduce>`)."""

from __future__ import annotations

import torch

from chaos.collectives.config import WIRE_NAMES
from chaos.collectives.links import overlaps

__all__ = ["check_tensors", "result_buffer"]

_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_tensors(
    tensor: torch.Tensor,
    op: str,
    out: torch.Tensor | None,
    wire_dtype: str | None,
    default_wire: str | None,
) -> tuple[torch.dtype, torch.dtype]:
    """Checks an allreduce's tensors and names its accumulation and wire dtypes.

    Args:
        tensor: The input.
        op: ``"sum"`` or ``"mean"``.
        out: The optional output.
        wire_dtype: The call's wire format name, or ``None`` for ``default_wire``.
        default_wire: The communicator's wire format name (``None``: the accumulation dtype).

    Returns:
        ``(accumulation dtype, wire dtype)``.

    Raises:
        TypeError: not a float CPU tensor.
        ValueError: an unknown op or wire format (or int8 for float64), or an ``out`` of
            another shape or dtype.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"allreduce takes a torch.Tensor, not {type(tensor).__name__}")
    if tensor.dtype not in _INPUT_DTYPES or tensor.device.type != "cpu":
        raise TypeError(f"allreduce supports float CPU tensors, not {tensor.dtype}")
    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', not {op!r}")
    if out is not None and (out.shape != tensor.shape or out.dtype != tensor.dtype):
        raise ValueError("out must have the input's shape and dtype")
    acc = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    name = wire_dtype if wire_dtype is not None else default_wire
    if name is None:
        return acc, acc
    if name not in WIRE_NAMES:
        raise ValueError(f"wire_dtype must be one of {sorted(WIRE_NAMES)} or None")
    if name == "int8" and acc != torch.float32:
        raise ValueError("the int8 wire format takes float32, float16 or bfloat16 tensors")
    return acc, WIRE_NAMES[name]


def result_buffer(
    tensor: torch.Tensor, out: torch.Tensor | None, acc_dtype: torch.dtype
) -> torch.Tensor:
    """``out`` itself (flat) when it can accumulate (right dtype, contiguous, not sharing the
    input's memory), else a new flat buffer."""
    if out is not None and out.dtype == acc_dtype and out.is_contiguous() and not overlaps(
        out, tensor
    ):
        return out.view(-1)
    return torch.empty(tensor.numel(), dtype=acc_dtype)
