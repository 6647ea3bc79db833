"""Modules wrapping nanfree.ops, drop-in for their torch.nn counterparts."""

import torch

from . import ops

__all__ = ["Softmax", "LogSoftmax", "CosineSimilarity"]


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


class CosineSimilarity(torch.nn.Module):
    """``torch.nn.CosineSimilarity(dim, eps)`` with nanfree's cosine_similarity."""

    def __init__(self, dim: int = 1, eps: float = 1e-8) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        return ops.cosine_similarity(x1, x2, self.dim, self.eps)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, eps={self.eps}"
