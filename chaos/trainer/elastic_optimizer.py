"""A drop-in elastic optimizer: any torch optimizer whose ``step()`` is the :class:`Trainer`'s
``update()``, for loops a script does not write itself (Hugging Face ``transformers.Trainer``,
Lightning; :mod:`chaos.integrations`).

Usage::

    opt = ElasticOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), model, join=JOIN,
                           scheduler=lambda o: LambdaLR(o, warmup), clip_grad_norm=1.0)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()                     # allreduce; clip the average; AdamW's step; the schedule
        opt.scheduler.step()           # may stay: the schedule already advanced inside step()

``step()`` runs ``Trainer.update()``: the gradients are averaged over the members, then, on the
averaged gradient and on every member alike, ``clip_grad_norm`` clips them, the wrapped
optimizer steps and the scheduler advances (the ``before_step``, ``step_fn`` and
``after_step`` hooks), and then ``check_state_replication()``. The scheduler is built on the
wrapper by a factory, before the cluster is joined, so that it travels to joiners with the
model and the optimizer (``extra_state``); the object the framework sees
(:attr:`ElasticOptimizer.scheduler`) ignores the framework's own ``step()`` calls, which come
after ``optimizer.step()``: a donor's state is captured as ``update()`` returns, so the schedule
must already have advanced by then (``docs/trainer.md``, *extra_state is advanced in
after_step*).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from chaos.errors import ChaosError, ConfigError
from chaos.trainer.trainer import Trainer

__all__ = ["ElasticOptimizer", "OwnedScheduler"]

SCHEDULER_KEY = "lr_scheduler"
"""The ``extra_state`` name the wrapper's scheduler travels under."""

_HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


class OwnedScheduler(LRScheduler):
    """The face of the wrapper's LR scheduler that a framework holds.

    The schedule advances inside :meth:`ElasticOptimizer.step` (``after_step``), so this
    object's :meth:`step` does nothing: frameworks call it after ``optimizer.step()``.
    Everything else (``get_last_lr``, ``state_dict``, ``last_epoch``, ...) is the real
    scheduler's.

    Args:
        inner: The real scheduler, built on the :class:`ElasticOptimizer`.
    """

    def __init__(self, inner: LRScheduler) -> None:  # noqa: D107 - no LRScheduler.__init__:
        self.inner = inner  # it would step the schedule once more

    @property
    def optimizer(self) -> torch.optim.Optimizer:  # type: ignore[override]
        """The optimizer the real scheduler is built on (the wrapper)."""
        return self.inner.optimizer

    @property
    def last_epoch(self) -> int:  # type: ignore[override]
        """The real scheduler's step count."""
        return int(self.inner.last_epoch)

    def step(self, epoch: int | None = None) -> None:
        """Does nothing: the schedule advanced inside the optimizer's ``step()``."""

    def get_last_lr(self) -> list[float | torch.Tensor]:
        """The learning rates the real scheduler set last."""
        return list(self.inner.get_last_lr())

    def get_lr(self) -> list[float | torch.Tensor]:
        """The real scheduler's learning rates."""
        return list(self.inner.get_lr())

    def state_dict(self) -> dict[str, Any]:
        """The real scheduler's state."""
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads the real scheduler's state."""
        self.inner.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


class ElasticOptimizer(torch.optim.Optimizer):
    """Wraps a torch optimizer so that its ``step()`` is an elastic cluster's step.

    Constructing it joins the cluster (``join=``) or founds one (``join=None``), as the
    :class:`Trainer` does: a joiner's model, optimizer and scheduler come out bitwise equal to
    the members'. Build it after the model is on its device and before the first forward.

    ``param_groups``, ``state``, ``defaults``, ``zero_grad()``, ``state_dict()`` and
    ``load_state_dict()`` are the wrapped optimizer's; an LR scheduler built on the wrapper sets
    the wrapped optimizer's learning rates.

    Args:
        optimizer: The optimizer to wrap (not stepped by anything else).
        model: The model whose parameters it steps (the :class:`Trainer` replicates it).
        join: A member's ``tcp://HOST:PORT`` to join through; ``None``: a new cluster.
        scheduler: Builds the LR scheduler on the wrapper (``lambda opt: LambdaLR(opt, f)``):
            it advances inside :meth:`step`, on every member alike, and travels to joiners.
            :attr:`scheduler` is the object to hand to a framework.
        clip_grad_norm: Clips the *averaged* gradient to this L2 norm before the optimizer
            steps (``None``: no clipping). :attr:`last_grad_norm` is its norm before clipping.
        extra_state: More state that travels, as the :class:`Trainer`'s ``extra_state``.
        daemon: As the :class:`Trainer`'s.
        node_id: As the :class:`Trainer`'s.
        listen: As the :class:`Trainer`'s.
        **options: :class:`~chaos.trainer.TrainerConfig` fields.

    Raises:
        ConfigError: ``optimizer`` is not a torch optimizer (or is already wrapped), a
            parameter of it is not ``model``'s, ``scheduler`` builds no LR scheduler on the
            wrapper or a ``ReduceLROnPlateau``, ``clip_grad_norm`` is not positive, or
            ``extra_state`` names the scheduler's key; the :class:`Trainer`'s errors otherwise.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        *,
        join: str | None = None,
        scheduler: Callable[[torch.optim.Optimizer], LRScheduler] | None = None,
        clip_grad_norm: float | None = None,
        extra_state: dict[str, Any] | None = None,
        daemon: str | None = None,
        node_id: str | None = None,
        listen: str | None = None,
        **options: Any,
    ) -> None:
        _check_wrapped(optimizer, model)
        self._inner = optimizer
        for hooks in _HOOK_DICTS:  # what torch.optim.Optimizer.__init__ would set (it is not
            setattr(self, hooks, OrderedDict())  # run: its param_groups would be the wrapped's)
        self.max_grad_norm = _check_clip(clip_grad_norm)
        self.last_grad_norm: float | None = None
        self.last_step_live = False
        self._real_scheduler: LRScheduler | None = None
        self.scheduler: OwnedScheduler | None = None
        self._trainer: Trainer | None = None
        extra = dict(extra_state or {})
        if scheduler is not None:
            if SCHEDULER_KEY in extra:
                raise ConfigError(f"extra_state names {SCHEDULER_KEY!r}, the scheduler's key")
            self._real_scheduler = _build_scheduler(scheduler, self)
            self.scheduler = OwnedScheduler(self._real_scheduler)
            extra[SCHEDULER_KEY] = self._real_scheduler
        self._trainer = Trainer(model, optimizer, join=join, daemon=daemon, node_id=node_id,
                                listen=listen, extra_state=extra, **options)  # fmt: skip

    # ------------------------------------------------------------ the wrapped optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's parameter groups (the same list)."""
        return self._inner.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self._inner.param_groups = groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's per-parameter state."""
        return self._inner.state

    @state.setter
    def state(self, state: Any) -> None:
        self._inner.state = state

    @property
    def defaults(self) -> dict[str, Any]:
        """The wrapped optimizer's defaults."""
        return self._inner.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self._inner.defaults = defaults

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._inner

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``."""
        self._inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state (its checkpoint format)."""
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads the wrapped optimizer's state. Every member must load the same one (a
        checkpoint restored everywhere, with ``restored=True``), or the members differ."""
        self._inner.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: the members' gradient layout is fixed when the cluster is joined.

        Raises:
            ChaosError: always (once constructed).
        """
        if getattr(self, "_trainer", None) is None:  # torch.optim.Optimizer.__init__ never
            self._inner.add_param_group(param_group)  # runs here, but stay faithful
            return
        raise ChaosError(
            "ElasticOptimizer: parameter groups cannot be added once the cluster is joined "
            "(every member's gradient layout must stay the same)"
        )

    def __repr__(self) -> str:
        return f"ElasticOptimizer({self._inner!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise ChaosError("an ElasticOptimizer holds a live cluster membership: pickle "
                         "its state_dict() instead")  # fmt: skip

    # ------------------------------------------------------------ the elastic step

    @property
    def trainer(self) -> Trainer:
        """The :class:`Trainer` underneath (events, ``world_size``, ``audit``, ...)."""
        if self._trainer is None:
            raise ChaosError("the ElasticOptimizer was closed")
        return self._trainer

    @property
    def cluster_step(self) -> int:
        """The cluster's step (``Trainer.step``): equal on every member."""
        return self.trainer.step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, num_samples: int | None = None) -> Any:
        """One cluster step: ``closure()`` (forward and backward) if given, then the
        :class:`Trainer`'s ``update()`` (average; clip; the wrapped step; the schedule), then
        ``check_state_replication()``.

        :attr:`last_step_live` says whether a live step ran (``False``: this member joined
        inside the call and its gradients were dropped; :attr:`cluster_step` moved to the
        cluster's).

        Args:
            closure: Recomputes the loss with its backward pass, as for any torch optimizer.
            num_samples: This member's samples in the step (sample-weighted averaging;
                ``None``: every member weighs the same).

        Returns:
            The closure's loss, or ``None``.
        """
        trainer = self.trainer
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_step_live = trainer.update(
            num_samples, before_step=self._clip, step_fn=self._inner.step, after_step=self._advance
        )
        trainer.check_state_replication()
        return loss

    def _clip(self) -> None:
        """``before_step``: clips the averaged gradient (the same on every member)."""
        if self.max_grad_norm is None:
            return
        params = [p for g in self._inner.param_groups for p in g["params"]]
        norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        self.last_grad_norm = float(norm)

    def _advance(self) -> None:
        """``after_step``: advances the schedule, so that a donor's state has it."""
        if self._real_scheduler is not None:
            self._real_scheduler.step()

    def request_node_exit(self, timeout_s: float = 15.0) -> None:
        """Leaves the cluster gracefully (scale-in) and closes the :class:`Trainer`."""
        trainer, self._trainer = self.trainer, None
        trainer.request_node_exit(timeout_s)

    def close(self) -> None:
        """Closes the :class:`Trainer` without a graceful leave (idempotent)."""
        trainer, self._trainer = self._trainer, None
        if trainer is not None:
            trainer.close()


def _check_wrapped(optimizer: object, model: torch.nn.Module) -> None:
    """Raises ConfigError unless ``optimizer`` is a plain torch optimizer over ``model``'s
    parameters."""
    if isinstance(optimizer, ElasticOptimizer):
        raise ConfigError("ElasticOptimizer: the optimizer is already an ElasticOptimizer")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"ElasticOptimizer wraps a torch.optim.Optimizer, got "
                          f"{type(optimizer).__name__}")  # fmt: skip
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"ElasticOptimizer: model must be a torch.nn.Module, got "
                          f"{type(model).__name__}")  # fmt: skip
    owned = {id(p) for p in model.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in owned:
                raise ConfigError("ElasticOptimizer: the optimizer steps a parameter that is "
                                  "not the model's (build it on model.parameters())")  # fmt: skip


def _check_clip(value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e308:
        raise ConfigError(f"clip_grad_norm must be None or a positive number, got {value!r}")
    return float(value)


def _build_scheduler(
    factory: Callable[[torch.optim.Optimizer], LRScheduler], opt: ElasticOptimizer
) -> LRScheduler:
    if not callable(factory):
        raise ConfigError("scheduler must build the LR scheduler on the optimizer it is given, "
                          "e.g. scheduler=lambda opt: LambdaLR(opt, f)")  # fmt: skip
    sched = factory(opt)
    if isinstance(sched, ReduceLROnPlateau):
        raise ConfigError("ReduceLROnPlateau is not supported: its step needs a metric, which "
                          "the members do not share")  # fmt: skip
    if not isinstance(sched, LRScheduler) or sched.optimizer is not opt:
        raise ConfigError("scheduler must return an LR scheduler built on the optimizer it is "
                          "given (the ElasticOptimizer)")  # fmt: skip
    return sched
