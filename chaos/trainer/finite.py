"""The finiteness guard of the gradients: one device's NaN, inf or exploding gradient must not
poison every member (``TrainerConfig.nonfinite``).

Two checks run on the packed gradient buffer (see :class:`~chaos.trainer.gradients.
GradientPacker`: ``n`` gradient elements weighted by the sample count, then the weight):

* **before it is sent** (:meth:`FiniteGuard.outgoing`): the local gradients must be finite and,
  with ``TrainerConfig.max_grad_norm`` set, their L2 norm (unweighted) at most that bound. A
  buffer that fails is *marked*: its gradient part is zeroed and one element, this member's
  slot (:func:`slot`, a hash of its id), set to NaN. It still takes part in the allreduce, so
  the round completes and every member receives the same sum.
* **before the average is applied** (:meth:`FiniteGuard.verdict`): the summed buffer must be
  finite, with a positive weight. Every member holds the same bits after the allreduce, so
  every member reaches the same verdict: all of them skip the step (or raise) alike. The
  members whose slot holds NaN are the devices named; a sum that is not finite without a
  named slot is an overflow of the average itself (no device named).

A member's slot is its id's hash modulo ``n``, the same on every member and under every
policy; two members whose ids share a slot (likelier the smaller the model) are both named
when one of them is bad.

Every member reports a skipped step's devices to its daemon (a
:class:`~chaos.protocol.NonfiniteStep`); the scheduler evicts a device named in too many steps
(:mod:`chaos.daemon.scheduler.offenders`). A step skipped is logged for a catching-up joiner as
the members held it (:meth:`FiniteGuard.replayed`): the joiner skips it alike.

The checks are single reductions over the flat buffer (a sum, or the norm when a bound is
set); only a buffer that fails them is scanned element-wise, to say why.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from chaos.errors import NonFiniteGradient
from chaos.trainer.config import NonFiniteMode

__all__ = ["FiniteGuard", "NonFiniteMode", "Verdict", "check_local", "mark_bad", "slot"]


@dataclass(frozen=True)
class Verdict:
    """A step whose summed gradients are not finite.

    Attributes:
        devices: The members whose contribution was marked bad, sorted (empty: the sum of
            finite contributions overflowed).
    """

    devices: tuple[str, ...]


def slot(node_id: str, n: int) -> int:
    """The element of an ``n``-element gradient part that marks ``node_id``'s contribution
    bad (the same on every member: a hash of the id, not of anything local)."""
    if n < 1:
        return 0
    digest = hashlib.blake2b(node_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % n


def check_local(buf: torch.Tensor, n: int, max_norm: float | None) -> str | None:
    """Why this member's packed gradients must not be sent as they are (``None``: they may).

    Args:
        buf: The packed buffer (``n`` weighted gradient elements, then the weight).
        n: The gradient elements in it.
        max_norm: The largest L2 norm of the unweighted gradients allowed; ``None``: no bound.

    Returns:
        ``"nan"``, ``"inf"`` (the first kind found) or ``"norm X > B"``; ``None`` when finite
        and within the bound.
    """
    grads = buf[:n]
    weight = float(buf[n]) if buf.numel() > n else 1.0
    if max_norm is None:
        total = float(grads.sum())
        if math.isfinite(total):
            return None  # a non-finite element always makes the sum non-finite
        return _kind(grads)
    norm = float(torch.linalg.vector_norm(grads))
    if not math.isfinite(norm):
        kind = _kind(grads)
        if kind is not None:
            return kind
    unweighted = norm / weight if weight > 0 else norm
    if not unweighted <= max_norm:
        return f"norm {unweighted:.3g} > {max_norm:g}"
    return None


def _kind(grads: torch.Tensor) -> str | None:
    """``"nan"`` or ``"inf"`` for a tensor holding one, ``None`` when every element is finite
    (its sum, or its norm, only overflowed)."""
    if bool(torch.isnan(grads).any()):
        return "nan"
    if bool(torch.isinf(grads).any()):
        return "inf"
    return None


def mark_bad(buf: torch.Tensor, n: int, node_id: str) -> None:
    """Marks a packed buffer as a bad contribution, in place: the gradient part zeroed, its
    weight kept, and NaN in ``node_id``'s :func:`slot`."""
    if n < 1:
        buf.fill_(math.nan)
        return
    buf[:n].zero_()
    buf[slot(node_id, n)] = math.nan


def reduced_verdict(buf: torch.Tensor, n: int, members: Iterable[str]) -> Verdict | None:
    """The verdict on a summed buffer: ``None`` when its gradient part is finite and its
    weight positive, else the members whose slot holds NaN.

    Args:
        buf: The allreduce's result (or a logged step's buffer, or the local one alone).
        n: The gradient elements in it.
        members: The members of the round (their slots are looked up).
    """
    head = buf[: n + 1]
    total = float(head.sum())
    weight = float(buf[n]) if buf.numel() > n else 1.0
    if math.isfinite(total) and weight > 0:
        return None
    if n < 1:
        return Verdict(tuple(sorted(set(members))))
    named = sorted(m for m in set(members) if math.isnan(float(buf[slot(m, n)])))
    if not named and weight > 0 and bool(torch.isfinite(head).all()):
        return None  # the sum of the check overflowed, not an element
    return Verdict(tuple(named))


class FiniteGuard:
    """One trainer's finiteness checks and its record of offences.

    Args:
        mode: What a non-finite step does.
        max_norm: The bound on the local gradients' L2 norm (``None``: none).
        n: The gradient elements of the packed buffer.
        node_id: This member's id.

    Attributes:
        offences: Member id -> the steps its contribution was marked bad (the same on every
            member: every member decodes the same sum).
        skipped: Steps skipped so far.
        local_reason: Why this member's own gradients of the step in progress were marked
            (``None``: they were not).
    """

    def __init__(self, mode: NonFiniteMode, max_norm: float | None, n: int,
                 node_id: str) -> None:  # fmt: skip
        self.mode = mode
        self.max_norm = max_norm
        self.n = n
        self.node_id = node_id
        self.offences: dict[str, int] = {}
        self.skipped = 0
        self.local_reason: str | None = None
        self._last_members: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        """Whether the checks run (the mode is not ``off``)."""
        return self.mode is not NonFiniteMode.OFF

    def outgoing(self, buf: torch.Tensor) -> torch.Tensor:
        """Checks this member's packed gradients before they are sent; marks them bad (in
        place) when they fail. Returns ``buf``."""
        self.local_reason = None
        if not self.active:
            return buf
        reason = check_local(buf, self.n, self.max_norm)
        if reason is not None:
            self.local_reason = reason
            mark_bad(buf, self.n, self.node_id)
        return buf

    def verdict(self, buf: torch.Tensor, members: Iterable[str]) -> Verdict | None:
        """The verdict on the buffer about to be applied (``None``: apply it; always ``None``
        when the mode is ``off``).

        The devices named are looked up among ``members`` and the members of the previous
        call: a round interrupted by a new policy (a member evicted, say) completes with the
        result the others kept, which the old members computed.
        """
        if not self.active:
            return None
        now = tuple(members)
        bad = reduced_verdict(buf, self.n, [*now, *self._last_members, self.node_id])
        self._last_members = now
        return bad

    def skips(self, buf: torch.Tensor) -> bool:
        """Whether a logged step's buffer is one the members skipped (a catching-up joiner
        skips it alike)."""
        return self.mode is NonFiniteMode.SKIP and reduced_verdict(buf, self.n, ()) is not None

    def replayed(
        self, buf: torch.Tensor, step: int, epoch: int, members: Iterable[str]
    ) -> dict[str, object] | None:
        """A catching-up joiner's verdict on a logged step: ``None`` to apply it, else the
        fields of its ``nonfinite_gradient`` event (``replayed``: true; ``epoch``: the one
        given, the epoch of the policy that planned the snapshot), the offence counted.

        A step the members skipped is logged as they held it, the non-finite sum itself (see
        :meth:`chaos.trainer.donor.Donor.log_step`), so the joiner reaches their verdict from
        the same bits and skips it alike; the devices named are those of ``members`` (the
        members the joiner knows of) whose slot holds NaN.
        """
        if self.mode is not NonFiniteMode.SKIP:
            return None  # "off": the members applied it too; "raise": they never logged it
        bad = reduced_verdict(buf, self.n, members)
        if bad is None:
            return None
        own, self.local_reason = self.local_reason, None  # not this device's gradients
        fields = self.record(bad, step, epoch)
        self.local_reason = own
        fields["replayed"] = True
        return fields

    def reported(self, bad: Verdict) -> tuple[str, ...]:
        """The devices to report to the daemon for a step skipped (the scheduler evicts a
        repeat offender): those named, in ``skip`` mode; none in ``raise`` mode (every
        member raises)."""
        return bad.devices if self.mode is NonFiniteMode.SKIP else ()

    def record(self, bad: Verdict, step: int, epoch: int) -> dict[str, object]:
        """Counts the offence of every device named and returns the ``nonfinite_gradient``
        event's fields.

        Raises:
            NonFiniteGradient: in ``raise`` mode (after counting).
        """
        for dev in bad.devices:
            self.offences[dev] = self.offences.get(dev, 0) + 1
        action = "raised" if self.mode is NonFiniteMode.RAISE else "skipped"
        fields: dict[str, object] = {
            "step": step, "epoch": epoch, "devices": list(bad.devices), "action": action,
            "local": self.local_reason, "offences": {d: self.offences[d] for d in bad.devices},
        }  # fmt: skip
        if self.mode is NonFiniteMode.SKIP:
            self.skipped += 1
        return fields

    def raise_if(self, bad: Verdict, step: int) -> None:
        """Raises in ``raise`` mode.

        Raises:
            NonFiniteGradient: the mode is ``raise``; it names the devices and the step.
        """
        if self.mode is not NonFiniteMode.RAISE:
            return
        who = ", ".join(bad.devices) if bad.devices else "no single device (the sum overflowed)"
        mine = f"; this device's gradients: {self.local_reason}" if self.local_reason else ""
        raise NonFiniteGradient(
            f"the averaged gradients of step {step} are not finite: bad contribution from "
            f"{who}{mine} (TrainerConfig.nonfinite='raise'; every member raises alike)",
            step=step, devices=bad.devices,
        )  # fmt: skip
