"""The gradients' way into the allreduce and the average's way back.

The allreduce works on one flat CPU buffer per step: every gradient, flattened in parameter
order, multiplied by this device's sample count, and one last element that holds the sample
count itself (the allreduce sums it alongside). The average is ``sum(N_i * g_i) / sum(N_i)``,
computed on the host, so every member divides the same bits by the same count and the members
stay bitwise equal whatever device they train on.

Gradients on an accelerator are packed on the device, copied to a host buffer (pinned when CUDA
is available) in one transfer, and the average goes back in one transfer
(:mod:`chaos.replication.staging` decides which tensors need it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from chaos import ops
from chaos.replication.staging import copy_between, host_buffer, needs_staging

__all__ = ["GradientPacker"]


class GradientPacker:
    """Packs a model's gradients for the allreduce and installs the average in them.

    Args:
        params: The optimizer's parameters, in param-group order; all on one device.

    Raises:
        ValueError: the parameters are on more than one device (a model split over devices
            is not supported: move it to one).
    """

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        devices = {p.device for p in params}
        if len(devices) > 1:
            names = ", ".join(sorted(str(d) for d in devices))
            raise ValueError(
                f"the optimizer's parameters are on several devices ({names}); Chaos trains a "
                "model that lives on one device: move it there before building the Trainer"
            )
        self._params = list(params)
        self._staged = bool(self._params) and needs_staging(self._params[0])

    @property
    def device(self) -> torch.device:
        """The parameters' device (the CPU for a model without parameters)."""
        return self._params[0].device if self._params else torch.device("cpu")

    def pack(self, num_samples: int | None) -> torch.Tensor:
        """The gradients, weighted by ``num_samples``, in one new host buffer whose last
        element holds the weight.

        Args:
            num_samples: This step's local sample count; ``None`` weighs 1 and leaves the
                gradients unscaled.

        Returns:
            A 1-D CPU tensor of the gradients' dtype with ``numel + 1`` elements.
        """
        grads = [p.grad.detach() if p.grad is not None else torch.zeros_like(p)
                 for p in self._params]  # fmt: skip
        n = sum(g.numel() for g in grads)
        dtype = grads[0].dtype if grads else torch.float32
        weight = 1.0 if num_samples is None else float(num_samples)
        if self._staged:
            packed = ops.pack(grads)  # on the device: one transfer instead of one per tensor
            if num_samples is not None:
                packed.mul_(weight)
            buf = host_buffer((n + 1,), dtype)
            copy_between(buf[:n], packed)
        else:
            buf = torch.empty(n + 1, dtype=dtype)
            flat = ops.pack(grads, out=buf)
            if num_samples is not None:
                flat.mul_(weight)
        buf[n] = weight
        return buf

    def zeros(self) -> torch.Tensor:
        """A buffer as :meth:`pack` makes, all zeros: no gradient and weight 0 (a joiner that
        enters the allreduce with gradients computed on an older state)."""
        n = sum(p.numel() for p in self._params)
        dtype = self._params[0].dtype if self._params else torch.float32
        return torch.zeros(n + 1, dtype=dtype)

    def install(self, reduced: torch.Tensor) -> None:
        """Writes the sample-weighted mean, ``sum(N_i * g_i) / sum(N_i)``, into the gradients.

        Args:
            reduced: The allreduce's result (a buffer as :meth:`pack` makes, summed over the
                members); not modified (it is kept for a member that catches up).
        """
        n = reduced.numel() - 1
        for p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        average = reduced[:n].div(reduced[n])
        if self._staged:
            on_device = torch.empty(n, dtype=average.dtype, device=self.device)
            copy_between(on_device, average)
            average = on_device
        ops.unpack(average, [p.grad for p in self._params if p.grad is not None])
