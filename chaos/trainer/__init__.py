"""The trainer runtime: the :class:`Trainer` a PyTorch script uses, and what it runs on.

Modules:

* :mod:`chaos.trainer.trainer`: the :class:`Trainer` (step, install, state dict, close) and
  :class:`TrainerConfig`; it wires the three collaborators below;
* :mod:`chaos.trainer.session`: the session with the local daemon (registration, the policy,
  waiting for one, reports);
* :mod:`chaos.trainer.policy_watch`: the notices the local daemon publishes;
* :mod:`chaos.trainer.dataplane`: the allreduce communicator and the shard server;
* :mod:`chaos.trainer.donor`: the training state's layout, the donor's snapshots, the joiner's
  pull;
* :mod:`chaos.trainer.embedded`: the daemon a script starts for itself;
* :mod:`chaos.trainer.exit_signals`: the exit event (``capture_exit_event``);
* :mod:`chaos.trainer.local_steps`: :class:`LocalSteps`, the local-steps (DiLoCo-style) mode
  built on the :class:`Trainer`.

Importing this package imports torch; the daemon never imports it.
"""

from chaos.trainer.exit_signals import capture_exit_event, request_exit
from chaos.trainer.local_steps import LocalSteps, LocalStepsConfig
from chaos.trainer.trainer import Trainer, TrainerConfig, TrainingStalled

__all__ = [
    "LocalSteps",
    "LocalStepsConfig",
    "Trainer",
    "TrainerConfig",
    "TrainingStalled",
    "capture_exit_event",
    "request_exit",
]
