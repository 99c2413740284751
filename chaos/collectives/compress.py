"""Blockwise int8 compression of allreduce payloads, with error feedback (pure: no I/O).

The format (the ``"int8"`` wire dtype of :class:`~chaos.collectives.config.CommunicatorConfig`):
a chunk of ``n`` values is cut into blocks of :data:`BLOCK` values from the chunk's start (the
last block may be shorter). Each block gets one float32 scale ``s = amax / 127``, where
``amax`` is the largest magnitude of the block's *finite* values, and each value becomes
``q = clamp(round_half_even(x / s), -127, 127)``. A payload is the ``ceil(n / BLOCK)`` scales
(float32, the host's byte order) followed by the ``n`` int8 codes: :func:`payload_bytes` bytes.

* **Decoding** is ``q * s`` in float32 (exact to one rounding); a block whose ``amax`` is zero
  (or so small that ``amax / 127`` underflows) has ``s = 0`` and decodes to zeros.
* **Non-finite values** (NaN, +inf, -inf) get the code ``-128``, which no finite value uses,
  and decode to NaN *at their own position*; the block's other values are quantised as usual
  from the finite ``amax``. A non-finite gradient is thus never turned finite, and the element
  that carries it stays the one that is NaN (the trainer's finiteness guard names a device by
  the position of a NaN it planted, see :mod:`chaos.trainer.finite`); an infinity arrives as
  NaN.
* **Determinism.** Every step is an IEEE-754 operation rounded once (a maximum, one division,
  one round-half-even, one multiplication) on float32 values, elementwise, so every machine
  computes the same bytes from the same input, whatever its vector width or thread count.
  The allreduce computes each final value on one member and every member, that one included,
  takes the decoded value, so the results stay bitwise equal.

**Error feedback** (:class:`ErrorFeedback`): what a member's quantisation lost is kept locally
as a residual and added to the member's next input. The residual of an element is the error of
the one encoding this member made of it in a round: of its own values (its first send), of a
partial sum including its values (an inner hop), or of the final value (times the member count
for a mean, since a mean divides it again). So the running sum of the results tracks the
running sum of the exact results to within the members' current residuals, which stay bounded
by half a quantisation step each instead of growing with the number of rounds.
"""

from __future__ import annotations

import torch

__all__ = [
    "BLOCK", "NAN_CODE", "ErrorFeedback", "blocks", "decode", "encode", "payload_bytes",
]  # fmt: skip

BLOCK = 256
"""Values per block, each block with its own float32 scale (4 bytes per 256: 1.6% overhead)."""

NAN_CODE = -128
"""The int8 code of a non-finite value (decodes to NaN); finite values use -127..127."""

_QMAX = 127.0


def blocks(n: int) -> int:
    """The number of blocks (and scales) of a payload of ``n`` values."""
    return -(-n // BLOCK)


def payload_bytes(n: int) -> int:
    """The bytes of the payload of ``n`` values: the scales, then one byte per value."""
    return 4 * blocks(n) + n


def encode(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Quantises the float32 values ``x`` (1-D, contiguous) to a payload.

    Args:
        x: The values; only read.
        out: Optional uint8 buffer of :func:`payload_bytes` ``(x.numel())`` bytes to write to.

    Returns:
        The payload (uint8, ``out`` when given).

    Raises:
        ValueError: ``x`` is not a 1-D float32 tensor, or ``out`` has the wrong size or dtype.
    """
    if x.dtype != torch.float32 or x.dim() != 1:
        raise ValueError(f"encode takes a 1-D float32 tensor, not {x.dim()}-D {x.dtype}")
    n = x.numel()
    nb, size = blocks(n), payload_bytes(n)
    if out is None:
        out = torch.empty(size, dtype=torch.uint8)
    elif out.dtype != torch.uint8 or out.numel() != size:
        raise ValueError(f"out must be {size} uint8 bytes, not {out.numel()} x {out.dtype}")
    if n == 0:
        return out
    padded = torch.zeros(nb * BLOCK, dtype=torch.float32)
    padded[:n] = x
    grid = padded.view(nb, BLOCK)
    finite = torch.isfinite(grid)
    mags = torch.where(finite, grid.abs(), 0.0)
    scales = mags.amax(dim=1) / _QMAX
    safe = torch.where(scales > 0, scales, 1.0)  # s = 0: every |x| <= amax is tiny, q = 0
    codes = torch.round(torch.where(finite, grid, 0.0) / safe[:, None]).clamp_(-_QMAX, _QMAX)
    codes = torch.where(finite, codes, float(NAN_CODE)).to(torch.int8)
    out[: 4 * nb].view(torch.float32).copy_(scales)
    out[4 * nb :].view(torch.int8).copy_(codes.view(-1)[:n])
    return out


def decode(payload: torch.Tensor, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 values of a payload of ``n`` values.

    Args:
        payload: The uint8 payload of :func:`payload_bytes` ``(n)`` bytes.
        n: The number of values.
        out: Optional float32 buffer of ``n`` values to write to.

    Returns:
        The values (``out`` when given); non-finite codes are NaN.

    Raises:
        ValueError: the payload or ``out`` has the wrong size or dtype.
    """
    if payload.dtype != torch.uint8 or payload.numel() != payload_bytes(n):
        raise ValueError(f"payload of {n} values must be {payload_bytes(n)} uint8 bytes")
    if out is None:
        out = torch.empty(n, dtype=torch.float32)
    elif out.dtype != torch.float32 or out.numel() != n:
        raise ValueError(f"out must be {n} float32 values")
    if n == 0:
        return out
    nb = blocks(n)
    scales = payload[: 4 * nb].view(torch.float32)
    codes = payload[4 * nb :].view(torch.int8)
    full = (n // BLOCK) * BLOCK
    if full:
        torch.mul(codes[:full].view(-1, BLOCK), scales[: full // BLOCK, None],
                  out=out[:full].view(-1, BLOCK))  # fmt: skip
    if full < n:
        torch.mul(codes[full:], scales[-1], out=out[full:])
    bad = codes == NAN_CODE
    if bool(bad.any()):
        out.masked_fill_(bad, float("nan"))
    return out


class ErrorFeedback:
    """The residual of one member's int8 encodings of one tensor, kept from round to round.

    Pass the same instance to every allreduce of the same tensor (for example a trainer's
    gradient buffer). A round reads the residual (:meth:`residual`), writes the new one into a
    separate buffer (:meth:`pending`) element by element, and the communicator makes it current
    with :meth:`commit` when the round completed and wrote all of it; a failed round
    (:meth:`discard`), rerun under a new epoch, starts from the same residual again. A residual
    element that is not finite (its input was not) is stored as zero, so one bad step does not
    poison the later ones (the bad value itself travels on as NaN).
    """

    def __init__(self) -> None:
        self._residual: torch.Tensor | None = None
        self._pending: torch.Tensor | None = None
        self._written = 0

    @property
    def norm(self) -> float:
        """The L2 norm of the current residual (0 before the first round)."""
        r = self._residual
        return 0.0 if r is None else float(torch.linalg.vector_norm(r))

    def residual(self, numel: int) -> torch.Tensor | None:
        """The current residual, or ``None`` when there is none of ``numel`` elements (the
        first round, or the tensor's size changed: it starts from zero)."""
        r = self._residual
        return r if r is not None and r.numel() == numel else None

    def pending(self, numel: int) -> torch.Tensor:
        """Starts a round: the buffer the round writes the new residual into."""
        buf = self._pending
        if buf is None or buf.numel() != numel or buf is self._residual:
            buf = torch.empty(numel, dtype=torch.float32)
        self._pending, self._written = buf, 0
        return buf

    def wrote(self, a: int, b: int, error: torch.Tensor) -> None:
        """Stores the error of one encoding of elements ``[a, b)`` (each element once a round)."""
        pending = self._pending
        if pending is None:
            raise ValueError("wrote() before pending()")
        dest = pending[a:b]
        dest.copy_(error)
        dest.masked_fill_(~torch.isfinite(error), 0.0)
        self._written += b - a

    def discard(self) -> None:
        """Ends a round that failed: the previous residual stays (the rerun reads it again)."""
        self._pending = None

    def commit(self) -> bool:
        """Ends a round: the pending residual becomes current if the round wrote all of it.

        Returns:
            Whether it did (else the previous residual stays).
        """
        pending, self._pending = self._pending, None
        if pending is None or self._written != pending.numel():
            return False
        self._pending, self._residual = self._residual, pending  # reuse the old buffer next
        return True
