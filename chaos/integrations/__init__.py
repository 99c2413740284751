"""Chaos inside the training frameworks people already use.

Each module here is imported on its own, only by a script that uses its framework (the
framework is an optional extra, ``pip install chaos-edge[hf]``):

- :mod:`chaos.integrations.hf`: Hugging Face ``transformers.Trainer``, through an
  :class:`~chaos.trainer.elastic_optimizer.ElasticOptimizer` and
  :class:`~chaos.integrations.hf.ChaosCallback`;
- :mod:`chaos.integrations.lightning`: Lightning, through an ``ElasticOptimizer`` returned by
  ``configure_optimizers`` and :class:`~chaos.integrations.lightning.ChaosLightningCallback`.
"""
