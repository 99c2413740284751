"""Chaos: elastic, self-healing data-parallel training for edge devices.

This top-level package stays light: importing :mod:`chaos` must not import torch, because the
daemon (``chaos.daemon``) uses :mod:`chaos.errors` and the wire protocol without torch.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
