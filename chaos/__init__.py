"""Chaos: elastic, self-healing data-parallel training for edge devices.

This top-level package stays light: importing :mod:`chaos` must not import torch, because the
daemon (``chaos.daemon``) uses :mod:`chaos.errors` and the wire protocol without torch.
"""

from typing import Any

__version__ = "0.1.0"

__all__ = ["ElasticOptimizer", "__version__"]


def __getattr__(name: str) -> Any:
    """``chaos.ElasticOptimizer``, imported on first use (it imports torch)."""
    if name == "ElasticOptimizer":
        from chaos.trainer.elastic_optimizer import ElasticOptimizer  # noqa: PLC0415

        return ElasticOptimizer
    raise AttributeError(f"module 'chaos' has no attribute {name!r}")
