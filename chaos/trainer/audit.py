"""The online state audit: members compare digests of their state inside the step's allreduce.

Every ``audit_every`` steps (:attr:`TrainerConfig.audit_every`) each member computes a digest of
its training state at the step boundary: SHA-256 over the manifest of the state it would serve a
joiner (:class:`~chaos.replication.state.TrainingState`), whose chunk addresses cover every byte
of the parameters, buffers, optimizer tensors and extra state tensors, and which itself names the
hyperparameters, the optimizer's non-tensor values, the extra objects' plain state and the
runtime record's digest (step and the cluster-wide RNG seed). Members that hold bitwise-equal
state compute equal digests.

The digest travels in the step's allreduce, appended to the gradient buffer: each member owns
:data:`SLOT` elements, at its place among the sorted members, and writes its digest's first
:data:`SLOT` bytes there, each as ``byte + 1`` (1..256: exact in float16, bfloat16, float32 and
float64, so any wire dtype sums them exactly); every other slot is 0. The sum hands every
member every digest, so each member runs the same pure decision (:func:`odd_ones`) on the same
numbers and finds out by itself whether it is the odd one; no message is added.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from chaos.protocol.messages import AuditInfo

__all__ = ["SLOT", "AuditResult", "StateAudit", "decode_slots", "odd_ones"]

log = logging.getLogger("chaos.trainer")

SLOT = 8
"""Digest bytes each member contributes (64 bits: two different states share a slot's value
with probability 2**-64)."""


def odd_ones(digests: Mapping[str, bytes | None]) -> tuple[bytes | None, list[str]]:
    """Which members differ from the reference state (pure: no I/O).

    The reference is the digest the largest group of members holds; when several groups tie
    for largest (no majority, e.g. two members that differ), the group of the lowest member id
    among them wins. Members without a digest (``None``) are neither counted nor named.

    Args:
        digests: Each member's digest (``None``: it sent none).

    Returns:
        The reference digest (``None`` when no member sent one) and the members whose digest
        differs from it, sorted.
    """
    groups: dict[bytes, list[str]] = {}
    for member in sorted(digests):
        d = digests[member]
        if d is not None:
            groups.setdefault(d, []).append(member)
    if not groups:
        return None, []
    best = max(len(g) for g in groups.values())
    reference = min((g[0], d) for d, g in groups.items() if len(g) == best)[1]
    odd = sorted(m for d, g in groups.items() if d != reference for m in g)
    return reference, odd


def encode_slots(digest: bytes, rank: int, members: int, dtype: torch.dtype) -> torch.Tensor:
    """The audit tail of one member: its digest at slot ``rank`` of ``members``, zeros elsewhere."""
    tail = torch.zeros(members * SLOT, dtype=dtype)
    values = torch.tensor([b + 1 for b in digest[:SLOT]], dtype=torch.float64)
    tail[rank * SLOT : (rank + 1) * SLOT] = values.to(dtype)
    return tail


def decode_slots(tail: torch.Tensor, members: Sequence[str]) -> dict[str, bytes | None]:
    """Every member's digest from a summed audit tail (``None`` for a slot that is not one
    member's digest: empty, or not values in 1..256)."""
    vals = tail.to(torch.float64).tolist()
    out: dict[str, bytes | None] = {}
    for rank, member in enumerate(members):
        got = vals[rank * SLOT : (rank + 1) * SLOT]
        ok = len(got) == SLOT and all(float(v).is_integer() and 1 <= v <= 256 for v in got)
        out[member] = bytes(int(v) - 1 for v in got) if ok else None
    return out


@dataclass(frozen=True)
class AuditResult:
    """One audit's outcome on this member.

    Args:
        step: The step boundary audited (the state after ``step`` steps).
        agreed: Every member that sent a digest holds the reference state.
        odd: The members that differ from it.
        diverged: This member is one of them.
        members: How many members sent a digest.
    """

    step: int
    agreed: bool
    odd: tuple[str, ...]
    diverged: bool
    members: int


class StateAudit:
    """One member's part in the audit: the digest folded into the allreduce, the verdict read
    from its sum, the counts that ``status`` and the campaign report.

    Args:
        node_id: This member's id.
        every: Audit every this many steps (0: never).
        digest: The digest of this member's state at a step boundary (its argument: the step).
    """

    def __init__(self, node_id: str, every: int, digest: Callable[[int], bytes]) -> None:
        self.node_id = node_id
        self.every = every
        self._digest = digest
        self._pending: tuple[int, tuple[str, ...], int] | None = None  # step, members, tail
        self.last: AuditResult | None = None
        self.audits = 0
        self.mismatches = 0
        self.healed = 0
        self.first_diverged: int | None = None
        self.to_heal: AuditResult | None = None
        self._flip: tuple[int, int, int, int] | None = None
        self._buf: torch.Tensor | None = None  # the folded buffer, reused (see fold)

    def info(self) -> AuditInfo | None:
        """The record its daemon shows in ``status`` (``None`` before the first audit)."""
        last = self.last
        if last is None:
            return None
        return AuditInfo(step=last.step, agreed=last.agreed, audits=self.audits,
                         mismatches=self.mismatches, healed=self.healed)  # fmt: skip

    def due(self, step: int) -> bool:
        """Whether the boundary of ``step`` is audited."""
        return self.every > 0 and step > 0 and step % self.every == 0

    def fold(self, flat: torch.Tensor, step: int, members: Sequence[str]) -> torch.Tensor:
        """The buffer to allreduce: ``flat``, with the audit tail appended when ``step`` is
        audited and there are others to compare with (else ``flat`` itself)."""
        ordered = tuple(sorted(members))
        if not self.due(step) or len(ordered) < 2 or self.node_id not in ordered:
            self._pending = None
            return flat
        tail = encode_slots(self._digest(step), ordered.index(self.node_id), len(ordered),
                            flat.dtype)  # fmt: skip
        self._pending = (step, ordered, tail.numel())
        n, buf = flat.numel(), self._buf
        if buf is None or buf.numel() != n + tail.numel() or buf.dtype != flat.dtype:
            # kept from audit to audit: a new buffer of the gradients' size costs its page
            # faults every time (several times the copy), the copy alone is cheap
            buf = self._buf = torch.empty(n + tail.numel(), dtype=flat.dtype)
        buf[:n].copy_(flat)
        buf[n:].copy_(tail)
        return buf

    def unfold(self, reduced: torch.Tensor) -> torch.Tensor:
        """The gradient part of an allreduce's sum (a view of it); reads the audit's verdict
        from its tail."""
        pending, self._pending = self._pending, None
        if pending is None:
            return reduced
        step, members, n = pending
        digests = decode_slots(reduced[-n:], members)
        _, odd = odd_ones(digests)
        sent = sum(1 for d in digests.values() if d is not None)
        result = AuditResult(step, not odd, tuple(odd), self.node_id in odd, sent)
        self.last = result
        self.audits += 1
        if odd:
            self.mismatches += 1
        if result.diverged:
            if self.first_diverged is None:
                self.first_diverged = step
            self.to_heal = result
        return reduced[:-n]

    # -- fault injection

    def flip_bit_at(self, step: int, param: int, element: int, bit: int) -> None:
        """Arms a one-bit flip of ``params[param].flatten()[element]``, bit ``bit``, once the
        state reaches ``step`` (see :meth:`maybe_flip`).

        Raises:
            ValueError: a negative step, index or bit.
        """
        for name, v in (("step", step), ("param", param), ("element", element), ("bit", bit)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"flip_bit_at: {name} must be an int >= 0, got {v!r}")
        self._flip = (step, param, element, bit)

    def maybe_flip(self, step: int, params: Sequence[torch.Tensor]) -> bool:
        """Flips the armed bit when the state is at the armed step.

        Returns:
            Whether it flipped now.

        Raises:
            ValueError: the armed parameter, element or bit does not exist.
        """
        if self._flip is None or self._flip[0] != step:
            return False
        _, param, element, bit = self._flip
        self._flip = None
        if param >= len(params) or element >= params[param].numel():
            raise ValueError(f"flip_bit_at: no element {element} of parameter {param}")
        p = params[param]
        width = p.element_size() * 8
        if bit >= width:
            raise ValueError(f"flip_bit_at: bit {bit} of a {width}-bit element")
        ints = {8: torch.int8, 16: torch.int16, 32: torch.int32, 64: torch.int64}[width]
        with torch.no_grad():
            raw = p.data.reshape(-1).view(ints)
            raw[element] ^= torch.tensor(1 << bit if bit < width - 1 else -(1 << bit),
                                         dtype=ints)  # fmt: skip
        log.warning("%s: flipped bit %d of parameter %d element %d at step %d (fault injection)",
                    self.node_id, bit, param, element, step)  # fmt: skip
        return True
