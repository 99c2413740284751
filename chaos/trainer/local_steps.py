"""Local steps (DiLoCo style): each member trains on its own for a while, and the members
synchronise only at outer boundaries.

Usage (the sync-every-step loop with one line changed)::

    from chaos.trainer import LocalSteps

    trainer = LocalSteps(model, optimizer, join=JOIN, inner_steps=100, inner_time_s=30.0)
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        trainer.update(num_samples=len(x))   # optimizer.step(); at a boundary: the outer step
        trainer.check_state_replication()

How it is built: on top of the :class:`~chaos.trainer.Trainer`. A :class:`LocalSteps` keeps a
*global* copy of the model's parameters (:class:`GlobalParams`, a module that holds them and
nothing else) and an *outer* optimizer over it (default: SGD with Nesterov momentum, lr 0.7,
momentum 0.9, DiLoCo's published settings). The Trainer is built on the global copy and the
outer optimizer, so what it replicates and keeps bitwise equal on every member (joins, catch-up,
the online audit, kills and leaves) is exactly the global parameters, the outer optimizer's
state and ``extra_state``. The script's model and optimizer are the member's own: its *inner*
steps change them with no communication. At an outer boundary (:func:`outer_boundary`: after
``inner_steps`` inner steps or ``inner_time_s`` seconds, whichever comes first) the member sets
each global parameter's gradient to the pseudo-gradient ``global - local``
(:func:`pseudo_gradient`), the Trainer averages them weighted by the samples of the inner phase
and steps the outer optimizer, and the model is loaded from the new global parameters
(:func:`load_global`).

A joiner pulls the global parameters and the outer state; its inner optimizer starts from the
state its script built (fresh), see ``docs/trainer.md``, *Local steps*.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from chaos.errors import ConfigError
from chaos.trainer.config import check_num_samples
from chaos.trainer.overlap import BackgroundSync, progress, rebase
from chaos.trainer.trainer import Trainer

__all__ = [
    "DILOCO_OUTER_LR",
    "DILOCO_OUTER_MOMENTUM",
    "LOCAL_AUDIT_EVERY",
    "GlobalParams",
    "LocalSteps",
    "LocalStepsConfig",
    "load_global",
    "outer_boundary",
    "pseudo_gradient",
]

DILOCO_OUTER_LR = 0.7
"""The default outer learning rate (DiLoCo's Nesterov SGD)."""
DILOCO_OUTER_MOMENTUM = 0.9
"""The default outer momentum (DiLoCo's Nesterov SGD)."""
LOCAL_AUDIT_EVERY = 1
"""The state audit's default period in local mode, in outer steps: every outer step (an outer
step is many inner steps, so one digest of the global state per outer step is cheap)."""

log = logging.getLogger("chaos.trainer")

OuterFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
Hook = Callable[[], object]


@dataclass(frozen=True)
class LocalStepsConfig:
    """When the inner phase ends, and the default outer optimizer.

    Args:
        inner_steps: An outer boundary after this many inner steps; ``None``: no step bound.
        inner_time_s: An outer boundary once this many seconds have passed since the inner
            phase began (the first inner step that ends past it ends the phase); ``None``: no
            time bound. A slow device then takes fewer inner steps instead of making the
            others wait, and its pseudo-gradient weighs its samples.
        outer_lr: The default outer optimizer's learning rate.
        outer_momentum: Its momentum.
        outer_nesterov: Whether its momentum is Nesterov's.
        overlap: Whether the outer step runs in the background while the next inner phase
            computes (each pseudo-gradient is applied one outer step late; see
            :mod:`chaos.trainer.overlap`). ``False``: the member waits for each outer step.
        sync_timeout_s: With ``overlap``, how long a boundary waits at most for the previous
            outer step (the Trainer's own deadlines end it long before; this one bounds the
            wait itself).

    Raises:
        ConfigError: neither bound is set, or a value is out of range.
    """

    inner_steps: int | None = 100
    inner_time_s: float | None = None
    outer_lr: float = DILOCO_OUTER_LR
    outer_momentum: float = DILOCO_OUTER_MOMENTUM
    outer_nesterov: bool = True
    overlap: bool = False
    sync_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        h, t = self.inner_steps, self.inner_time_s
        if h is None and t is None:
            raise ConfigError("local steps need inner_steps, inner_time_s or both")
        if h is not None and (isinstance(h, bool) or not isinstance(h, int) or h < 1):
            raise ConfigError(f"inner_steps must be None or an int >= 1, got {h!r}")
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float))
                              or not 0 < t < math.inf):  # fmt: skip
            raise ConfigError(f"inner_time_s must be None or a positive number, got {t!r}")
        lr, mom = self.outer_lr, self.outer_momentum
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < math.inf:
            raise ConfigError(f"outer_lr must be a positive number, got {lr!r}")
        if isinstance(mom, bool) or not isinstance(mom, (int, float)) or not 0 <= mom < 1:
            raise ConfigError(f"outer_momentum must be in [0, 1), got {mom!r}")
        if self.outer_nesterov and mom == 0:
            raise ConfigError("outer_nesterov needs a positive outer_momentum")
        if not isinstance(self.overlap, bool):
            raise ConfigError(f"overlap must be a bool, got {self.overlap!r}")
        st = self.sync_timeout_s
        if isinstance(st, bool) or not isinstance(st, (int, float)) or not 0 < st < math.inf:
            raise ConfigError(f"sync_timeout_s must be a positive number, got {st!r}")

    def outer_optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The default outer optimizer over the global parameters ``params``."""
        return torch.optim.SGD(params, lr=self.outer_lr, momentum=self.outer_momentum,
                               nesterov=self.outer_nesterov)  # fmt: skip


# ----------------------------------------------------------------------------- pure parts


def outer_boundary(
    inner_done: int,
    elapsed_s: float,
    inner_steps: int | None,
    inner_time_s: float | None,
    samples: int = 0,
    sample_budget: int | None = None,
) -> bool:
    """Whether the inner phase ends now: after ``inner_steps`` inner steps, ``inner_time_s``
    seconds or ``sample_budget`` samples, whichever comes first. A phase holds at least one
    inner step.

    Args:
        inner_done: Inner steps taken in this phase so far.
        elapsed_s: Seconds since the phase began.
        inner_steps: The step bound (``None``: none).
        inner_time_s: The time bound (``None``: none).
        samples: Samples of this phase's inner steps so far.
        sample_budget: The sample bound (``None``: none): this member's share of the global
            batch, which the scheduler splits by the members' measured speed.
    """
    if inner_done < 1:
        return False
    if inner_steps is not None and inner_done >= inner_steps:
        return True
    if sample_budget is not None and samples >= sample_budget:
        return True
    return inner_time_s is not None and elapsed_s >= inner_time_s


def pseudo_gradient(
    global_params: Sequence[torch.Tensor], local_params: Sequence[torch.Tensor]
) -> None:
    """Sets each global parameter's ``grad`` to ``global - local``, the pseudo-gradient of the
    inner phase (what the outer optimizer descends along), in the global parameter's dtype.

    Raises:
        ValueError: the two lists differ in length or a pair in shape.
    """
    if len(global_params) != len(local_params):
        raise ValueError(f"{len(global_params)} global parameters, {len(local_params)} local")
    with torch.no_grad():
        for g, p in zip(global_params, local_params, strict=True):
            if g.shape != p.shape:
                raise ValueError(f"shapes differ: global {tuple(g.shape)}, local {tuple(p.shape)}")
            delta = g.detach() - p.detach().to(device=g.device, dtype=g.dtype)
            if g.grad is None:
                g.grad = delta
            else:
                g.grad.copy_(delta)


def load_global(
    local_params: Sequence[torch.Tensor], global_params: Sequence[torch.Tensor]
) -> None:
    """Copies the global parameters into the model's (the start of the next inner phase)."""
    with torch.no_grad():
        for p, g in zip(local_params, global_params, strict=True):
            p.copy_(g)


class GlobalParams(torch.nn.Module):
    """The global parameters: a copy of a model's parameters, and nothing else (its buffers,
    BatchNorm's running statistics say, stay each member's own).

    Args:
        params: The model's parameters (copied; ``requires_grad`` kept).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList(
            torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in params
        )

    def trainable(self) -> list[torch.nn.Parameter]:
        """The global parameters the outer optimizer steps (those with ``requires_grad``)."""
        return [p for p in self.params if p.requires_grad]


# ----------------------------------------------------------------------------- the wrapper


class LocalSteps:
    """A training member that synchronises at outer boundaries only (DiLoCo style).

    Args:
        model: The model; trained locally by ``optimizer`` between boundaries.
        optimizer: The inner optimizer (this member's own: its state is never sent).
        join: As for :class:`~chaos.trainer.Trainer`.
        daemon: As for the Trainer.
        node_id: As for the Trainer.
        listen: As for the Trainer.
        extra_state: Replicated state advanced only at outer boundaries (an outer LR
            scheduler, stepped in ``after_outer_step``); every member names the same objects.
            Inner-phase objects (an inner LR scheduler) are local: leave them out.
        inner_steps: See :class:`LocalStepsConfig` (default 100).
        inner_time_s: See :class:`LocalStepsConfig`.
        overlap: See :class:`LocalStepsConfig`: the outer step runs in the background while
            the next inner phase computes.
        outer_optimizer: Builds the outer optimizer from the global parameters; ``None``: the
            config's Nesterov SGD.
        after_outer_step: Called on every member right after each outer optimizer step (the
            Trainer's ``after_step``): advance ``extra_state`` here. With ``overlap`` it runs
            on the background thread of the outer step.
        local: More :class:`LocalStepsConfig` fields (``outer_lr`` ...), as a config.
        **options: :class:`~chaos.trainer.TrainerConfig` fields. ``audit_every`` counts outer
            steps and defaults to :data:`LOCAL_AUDIT_EVERY`. ``global_batch`` counts the
            samples of one outer step over the cluster: the scheduler splits it by the
            members' measured speed, and a member's phase also ends once it has used its
            share (:attr:`phase_budget`), so that every member's phase takes about as long.

    Raises:
        ConfigError: bad options (as the Trainer's, or :class:`LocalStepsConfig`'s).
        ChaosError: as the Trainer's constructor.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        join: str | None = None,
        daemon: str | None = None,
        node_id: str | None = None,
        listen: str | None = None,
        extra_state: dict[str, Any] | None = None,
        *,
        inner_steps: int | None = 100,
        inner_time_s: float | None = None,
        overlap: bool = False,
        outer_optimizer: OuterFactory | None = None,
        after_outer_step: Hook | None = None,
        local: LocalStepsConfig | None = None,
        **options: Any,
    ) -> None:
        self.local_config = local if local is not None else LocalStepsConfig(
            inner_steps, inner_time_s, overlap=overlap)
        self.model = model
        self.optimizer = optimizer
        self._params = list(model.parameters())
        self.global_params = GlobalParams(self._params)
        factory = outer_optimizer or self.local_config.outer_optimizer
        self.outer_optimizer = factory(self.global_params.trainable())
        self._after_outer = after_outer_step
        options.setdefault("audit_every", LOCAL_AUDIT_EVERY)
        self.trainer = Trainer(self.global_params, self.outer_optimizer, join=join, daemon=daemon,
                               node_id=node_id, listen=listen, extra_state=extra_state,
                               **options)  # fmt: skip
        self.node_id = self.trainer.node_id
        self.inner_step = 0  # inner steps in this phase
        self.inner_steps_total = 0  # inner steps this member took since it started
        self.phase_samples = 0  # samples of this phase's inner steps
        self.phase_overlapped = 0  # inner steps of this phase that ran beside an outer step
        self.last_phase: dict[str, Any] = {}
        self._phase_started = time.monotonic()
        self._sync = BackgroundSync(self.local_config.sync_timeout_s)
        self._synced_live: bool | None = None  # the background outer step's result, once in
        self._anchor: list[torch.Tensor] = []  # with overlap: the trainable local parameters
        # at the phase's start, which its pseudo-gradient is measured from
        try:
            if join is not None:
                self._enter()
            self._start_phase()
        except BaseException:
            self.trainer.close()
            raise

    # ------------------------------------------------------------------ properties

    @property
    def step(self) -> int:
        """Outer steps taken by the cluster (equal on every member): the Trainer's step."""
        return self.trainer.step

    @property
    def phase_budget(self) -> int | None:
        """With ``global_batch``: this member's samples for the inner phase (its share of the
        global batch, split by the members' measured speed); ``None`` without."""
        return self.trainer.local_batch_size

    @property
    def epoch(self) -> int:
        """The membership epoch of the policy in force."""
        return self.trainer.epoch

    @property
    def world_size(self) -> int:
        """Members taking part in the outer allreduce under the current policy."""
        return self.trainer.world_size

    @property
    def events(self) -> list[dict[str, Any]]:
        """The Trainer's events, and this wrapper's ``outer_step`` events."""
        return self.trainer.events

    def iter_events(self) -> Iterator[dict[str, Any]]:
        """The events seen so far, oldest first."""
        yield from self.trainer.events

    # ------------------------------------------------------------------ training

    def update(
        self,
        num_samples: int | None = None,
        *,
        before_step: Hook | None = None,
        step_fn: Hook | None = None,
        after_step: Hook | None = None,
    ) -> bool:
        """One inner step, and the outer step when the inner phase ends.

        Runs ``before_step()``, ``step_fn()`` (or the inner ``optimizer.step()``) and
        ``after_step()`` on this member's own gradients, with no communication. At an outer
        boundary it then averages the pseudo-gradients over the members, weighted by the
        samples of each member's inner phase, steps the outer optimizer, and loads the model
        from the new global parameters.

        Args:
            num_samples: The samples of this inner step (``None``: 1).
            before_step: Called before the inner step (clip the local gradient here).
            step_fn: Replaces the inner ``optimizer.step()``.
            after_step: Called after the inner step (an inner LR scheduler: local state).

        Returns:
            Whether this call ended an inner phase (the model now holds the global
            parameters of :attr:`step`; with ``overlap``, those plus the progress of the phase
            that just ended, whose outer step has begun in the background).

        Raises:
            TypeError, ValueError: a bad ``num_samples``.
            TrainingStalled: as the Trainer's ``update()``.
        """
        check_num_samples(num_samples)
        if num_samples == 0:
            raise ValueError("an inner step takes at least 1 sample")
        if before_step is not None:
            before_step()
        if step_fn is not None:
            step_fn()
        else:
            self.optimizer.step()
        if after_step is not None:
            after_step()
        self.inner_step += 1
        self.inner_steps_total += 1
        self.phase_overlapped += self._sync.running
        self.phase_samples += 1 if num_samples is None else num_samples
        cfg = self.local_config
        elapsed = time.monotonic() - self._phase_started
        budget = self.trainer.local_batch_size  # with global_batch: the speed-split share
        if not outer_boundary(self.inner_step, elapsed, cfg.inner_steps, cfg.inner_time_s,
                              self.phase_samples, budget):  # fmt: skip
            return False
        if cfg.overlap:
            self._outer_overlapped(elapsed)
        else:
            self._outer(elapsed)
        return True

    def _outer(self, elapsed_s: float) -> None:
        """The outer step: the pseudo-gradient's weighted average, the outer optimizer's step,
        then the model loaded from the global parameters (event ``outer_step``)."""
        pseudo_gradient(*self._trainable_pairs())
        step, t0 = self.trainer.step, time.monotonic()
        live = self.trainer.update(num_samples=self.phase_samples, after_step=self._after_outer)
        self.last_phase = {"step": step, "inner_steps": self.inner_step,
                           "samples": self.phase_samples, "inner_s": round(elapsed_s, 3),
                           "sync_s": round(time.monotonic() - t0, 3), "live": live}  # fmt: skip
        self.trainer.events.append({"t": time.time(), "node": self.node_id,
                                    "event": "outer_step", **self.last_phase})  # fmt: skip
        if not live:  # it joined again (evicted, healed): this phase's work was on an old state
            self._enter()
        self._start_phase()

    def _enter(self) -> None:
        """After a join: takes part in the members' current outer round contributing nothing
        (weight 0), so that nobody waits for an inner phase of this member's. A catching-up
        joiner's first ``update()`` enters without a live step; the next one is live."""
        while True:
            members = self.trainer.members
            if members == (self.node_id,):  # alone: nobody waits for it
                return
            for g in self.global_params.trainable():
                g.grad = torch.zeros_like(g)
            if self.trainer.update(num_samples=0, after_step=self._after_outer):
                return

    def _outer_overlapped(self, elapsed_s: float) -> None:
        """The boundary with ``overlap``: waits for the previous outer step, rebases the model
        on its global parameters plus this phase's progress, and starts this phase's outer
        step in the background (event ``outer_step``, with ``wait_s``: how long the member
        waited here, and ``sync_s``: how long the previous outer step took)."""
        t0 = time.monotonic()
        self._settle()
        waited, live = time.monotonic() - t0, self._synced_live
        self._synced_live = None
        trainable, local = self._trainable_pairs()
        step, samples = self.trainer.step, self.phase_samples
        self.last_phase = {"step": step, "inner_steps": self.inner_step, "samples": samples,
                           "inner_s": round(elapsed_s, 3), "sync_s": round(self._sync.took_s, 3),
                           "wait_s": round(waited, 3), "overlapped": self.phase_overlapped,
                           "live": live is not False}  # fmt: skip
        self.trainer.events.append({"t": time.time(), "node": self.node_id,
                                    "event": "outer_step", **self.last_phase})  # fmt: skip
        if live is False:  # joined again in the background: this phase ran on an old state
            self._start_phase()
            return
        delta = progress(self._anchor, local)
        rebase(local, trainable, delta)
        for g, d in zip(trainable, delta, strict=True):
            g.grad = d
        self._sync.start(lambda: self._background_step(samples), f"outer-{step}")
        self._begin_phase()

    def _background_step(self, samples: int) -> bool:
        """The outer step on the background thread: the Trainer's update (joining again when
        it was evicted), then serving a joiner if the scheduler asked. Returns whether the
        step was live."""
        live = self.trainer.update(num_samples=samples, after_step=self._after_outer)
        if not live:
            self._enter()
        self.trainer.check_state_replication()
        return live

    def _settle(self) -> None:
        """Waits for the background outer step, if one is pending, and keeps its result."""
        if self._sync.pending:
            self._synced_live = bool(self._sync.wait())

    def _trainable_pairs(self) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
        """The trainable global parameters and the model's parameters they stand for."""
        pairs = [(g, p) for p, g in zip(self._params, self.global_params.params, strict=True)
                 if g.requires_grad]  # fmt: skip
        return [g for g, _ in pairs], [p for _, p in pairs]

    def _start_phase(self) -> None:
        """The model takes the global parameters; the next inner phase begins."""
        load_global(self._params, list(self.global_params.params))
        self._begin_phase()

    def _begin_phase(self) -> None:
        """The next inner phase begins from the model as it is."""
        self.inner_step = 0
        self.phase_samples = 0
        self.phase_overlapped = 0
        self._phase_started = time.monotonic()
        if self.local_config.overlap:
            self._anchor = [p.detach().clone() for p in self._trainable_pairs()[1]]

    # ------------------------------------------------------------------ the rest

    def check_state_replication(self) -> bool:
        """As the Trainer's: serves the global state's shards to a joiner (call it after
        :meth:`update`). With ``overlap`` the background outer step does it after each
        update, and this returns ``False`` while one runs."""
        if self._sync.running:
            return False
        return self.trainer.check_state_replication()

    def request_node_exit(self, timeout_s: float = 15.0) -> None:
        """Leaves the cluster gracefully (at the boundary it is called at, once the outer step
        in the background has ended), then closes."""
        try:
            self._settle()
        finally:
            self.trainer.request_node_exit(timeout_s)

    def fail_at(self, step: int, after_frames: int = 0) -> None:
        """Fault injection: dies (``kill -9``) in the outer allreduce of outer step ``step``."""
        self.trainer.fail_at(step, after_frames)

    def state_dict(self) -> dict[str, Any]:
        """The Trainer's state (global parameters, outer optimizer, extra state, step) and this
        member's own: the model and the inner optimizer (after the outer step in the
        background, if one runs)."""
        self._settle()
        return {"outer": self.trainer.state_dict(), "model": self.model.state_dict(),
                "inner_optimizer": self.optimizer.state_dict(),
                "inner_step": self.inner_step}  # fmt: skip

    def close(self) -> None:
        """Closes the Trainer (its data plane, daemon connection and embedded daemon), after
        the outer step in the background, if one runs (what it raised is logged)."""
        try:
            self._settle()
        except Exception as exc:  # closing anyway: the error was the step's, not the close's
            log.warning("the background outer step failed: %s", exc)
        finally:
            self.trainer.close()

    def __enter__(self) -> LocalSteps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
