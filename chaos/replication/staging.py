"""Host staging: byte access to tensors wherever they live (CPU, CUDA or another device).

The state stream is read and written as bytes in host memory. A CPU tensor is its own host copy
(a zero-copy view of its memory); a tensor on an accelerator gets a host buffer, pinned when
CUDA is available so the copies run at DMA speed, and :class:`HostStaging` moves the bytes
between the two in one place:

* a donor calls :meth:`HostStaging.to_host` once, when its state is first read: the served
  bytes are the device tensors' values at that moment (the donor does not step while it
  serves, so they are the snapshot's);
* a joiner writes shards into the host buffers and calls :meth:`HostStaging.to_device` when
  the whole state has arrived and checked out.

Which tensors are staged is decided by :func:`needs_staging` alone, so the staging path can be
exercised on a machine without an accelerator by treating CPU tensors as if they lived on one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "HostStaging",
    "byte_view",
    "copy_between",
    "host_buffer",
    "needs_staging",
    "synchronize",
]


def needs_staging(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes must be copied through a host buffer (it is not in CPU memory)."""
    return t.device.type != "cpu"


def host_buffer(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor, pinned when CUDA is available."""
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=torch.cuda.is_available())


def synchronize(devices: set[torch.device]) -> None:
    """Waits until the queued copies to or from ``devices`` are done (CUDA streams only;
    copies to other devices are made blocking)."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def _asynchronous(device: torch.device) -> bool:
    """Whether a copy between ``device`` and pinned host memory may be queued (then
    :func:`synchronize` waits for it)."""
    return device.type == "cuda" and torch.cuda.is_available()


def copy_between(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` between host and device memory, returning once the copy is done.

    A copy between CUDA and pinned host memory is queued on the current stream and waited for;
    any other copy is blocking.
    """
    device = dst.device if dst.device.type != "cpu" else src.device
    queued = _asynchronous(device)
    with torch.no_grad():
        dst.copy_(src, non_blocking=queued)
    if queued:
        synchronize({device})


def byte_view(t: torch.Tensor, where: str) -> memoryview:
    """A writable zero-copy byte view of a contiguous CPU tensor's memory.

    Raises:
        TypeError: ``t`` is not a tensor.
        ValueError: ``t`` is not dense, not on the CPU, or not contiguous.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where} is a {type(t).__name__}, not a tensor")
    if t.layout != torch.strided:
        raise ValueError(f"{where}: only dense (strided) tensors are supported, got {t.layout}")
    if t.device.type != "cpu":
        raise ValueError(f"{where}: a byte view needs a CPU tensor, got device {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{where}: tensor is not contiguous; call .contiguous() on it first")
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray())
    arr: Any = flat.view(torch.uint8).numpy()
    return memoryview(arr)


class HostStaging:
    """Host copies of a list of tensors, for byte access to them.

    Args:
        tensors: The tensors, on any devices. Dense (strided) only; a CPU tensor that is not
            staged must also be contiguous (its memory is viewed directly).
        names: A name per tensor, for error messages.

    Raises:
        TypeError: a value is not a tensor.
        ValueError: a tensor is sparse, or a CPU tensor is not contiguous.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], names: Sequence[str]) -> None:
        if len(tensors) != len(names):
            raise ValueError(f"{len(tensors)} tensors but {len(names)} names")
        self._tensors = list(tensors)
        self._hosts: list[torch.Tensor] = []
        self._staged: list[int] = []
        for i, (t, name) in enumerate(zip(tensors, names, strict=True)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} is a {type(t).__name__}, not a tensor")
            if t.layout != torch.strided:
                raise ValueError(f"{name}: only dense (strided) tensors are supported")
            if needs_staging(t):
                self._hosts.append(host_buffer(t.shape, t.dtype))
                self._staged.append(i)
            else:
                if not t.is_contiguous():
                    raise ValueError(
                        f"{name}: tensor is not contiguous; call .contiguous() on it first"
                    )
                self._hosts.append(t.detach())
        self._names = list(names)

    @property
    def hosts(self) -> list[torch.Tensor]:
        """The host tensors, one per tensor: the tensor itself, or its host buffer."""
        return list(self._hosts)

    @property
    def staged(self) -> int:
        """How many tensors go through a host buffer."""
        return len(self._staged)

    def views(self) -> list[memoryview]:
        """A writable byte view of every host tensor, in order."""
        return [byte_view(h, n) for h, n in zip(self._hosts, self._names, strict=True)]

    def to_host(self) -> None:
        """Copies every staged tensor's values into its host buffer and waits for the copies."""
        self._copy(towards_host=True)

    def to_device(self) -> None:
        """Copies every host buffer into its staged tensor and waits for the copies."""
        self._copy(towards_host=False)

    def _copy(self, towards_host: bool) -> None:
        devices: set[torch.device] = set()
        with torch.no_grad():
            for i in self._staged:
                t, h = self._tensors[i], self._hosts[i]
                queued = _asynchronous(t.device)
                if towards_host:
                    h.copy_(t.detach(), non_blocking=queued)
                else:
                    t.copy_(h, non_blocking=queued)
                if queued:
                    devices.add(t.device)
        synchronize(devices)
