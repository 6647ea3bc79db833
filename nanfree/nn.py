"""Modules wrapping nanfree.ops, drop-in for their torch.nn counterparts."""

import torch

from . import ops

__all__ = ["Softmax", "LogSoftmax"]


class _OverDim(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class Softmax(_OverDim):
    """``torch.nn.Softmax(dim)`` without NaN; ``forward`` also takes ``mask=``."""

    def forward(self, input: torch.Tensor, *, mask=None) -> torch.Tensor:
        return ops.softmax(input, self.dim, mask=mask)


class LogSoftmax(_OverDim):
    """``torch.nn.LogSoftmax(dim)`` without NaN; ``forward`` also takes ``mask=``."""

    def forward(self, input: torch.Tensor, *, mask=None) -> torch.Tensor:
        return ops.log_softmax(input, self.dim, mask=mask)
