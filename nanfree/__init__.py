"""nanfree: numerically stable, NaN-free drop-in replacements for PyTorch operators."""

from . import debug, nn, ops, optim
from ._backends import BackendUnavailableError, backend_info

__all__ = ["ops", "nn", "debug", "optim", "backend_info", "BackendUnavailableError"]
__version__ = "0.1.0"
