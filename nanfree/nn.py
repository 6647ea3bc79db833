"""Modules wrapping nanfree.ops, drop-in for their torch.nn counterparts."""

import torch

from . import ops

__all__ = ["Softmax", "LogSoftmax", "CosineSimilarity", "GeM", "GeMTokenPooling"]


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


def _gem_p(p: float, learnable: bool):
    if learnable:
        # As cirtorch keeps it: Parameter(torch.ones(1) * p).
        return torch.nn.Parameter(torch.ones(1) * p)
    return float(p)


class GeM(torch.nn.Module):
    """GeM pooling of images (cirtorch's ``GeM``): ``[B, C, H, W] -> [B, C, 1, 1]``.
    With ``learnable=True`` (the default), ``p`` is a ``Parameter`` of shape [1]."""

    def __init__(self, p: float = 3.0, eps: float = 1e-6, learnable: bool = True) -> None:
        super().__init__()
        self.p = _gem_p(p, learnable)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.gem_pool2d(x, self.p, self.eps)

    def extra_repr(self) -> str:
        p = self.p.item() if isinstance(self.p, torch.Tensor) else self.p
        return f"p={p:.4f}, eps={self.eps}"


class GeMTokenPooling(torch.nn.Module):
    """GeM pooling of token embeddings ``[B, L, H] -> [B, H]`` over the tokens an
    ``attention_mask`` ``[B, L]`` keeps (nonzero = keep); a sequence with no kept
    token pools to 0 with gradient 0."""

    def __init__(self, p: float = 3.0, eps: float = 1e-6, learnable: bool = True) -> None:
        super().__init__()
        self.p = _gem_p(p, learnable)
        self.eps = eps

    def forward(self, token_embeddings: torch.Tensor, attention_mask=None) -> torch.Tensor:
        mask = None if attention_mask is None else attention_mask[..., None]
        return ops.gem(token_embeddings, self.p, 1, self.eps, mask=mask)

    def extra_repr(self) -> str:
        p = self.p.item() if isinstance(self.p, torch.Tensor) else self.p
        return f"p={p:.4f}, eps={self.eps}"
