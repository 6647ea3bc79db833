"""Drop-in replacements for torch functions that never return NaN from non-NaN input.

Signatures copy torch's; extras are keyword-only. See README.md for the contract.
"""

from collections.abc import Sequence

import torch

from . import _backends  # noqa: F401  (loads the kernels and registrations)

__all__ = ["softmax", "log_softmax", "logsumexp"]


def _check_input(op, input):
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"nanfree.{op}: `input` must be a torch.Tensor, got {type(input).__name__}")
    if not input.dtype.is_floating_point:
        raise TypeError(
            f"nanfree.{op}: `input` must be float16, bfloat16, float32 or float64, got {input.dtype}"
        )


def _check_dim(op, input, dim):
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"nanfree.{op}: `dim` must be an int, got {type(dim).__name__}")
    rank = max(input.dim(), 1)
    if not -rank <= dim < rank:
        raise IndexError(
            f"nanfree.{op}: `dim` {dim} is out of range for a tensor of {input.dim()} dimensions"
        )
    return dim % rank


def _check_mask(op, input, mask):
    """The mask as a bool tensor of the input's shape (possibly an expanded view)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"nanfree.{op}: `mask` must be a torch.Tensor or None")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(
            f"nanfree.{op}: `mask` must be bool or integer (nonzero = keep), got {mask.dtype}"
        )
    if mask.device != input.device:
        raise ValueError(
            f"nanfree.{op}: `mask` is on {mask.device} but `input` is on {input.device}"
        )
    try:
        shape = torch.broadcast_shapes(mask.shape, input.shape)
    except RuntimeError:
        shape = None
    if shape != input.shape:
        raise ValueError(
            f"nanfree.{op}: `mask` of shape {tuple(mask.shape)} does not broadcast to the "
            f"input's shape {tuple(input.shape)}"
        )
    if mask.dtype != torch.bool:
        mask = mask != 0
    return mask.expand(input.shape)


def _rows_over(input, mask, dims):
    """Moves `dims` to the end and flattens them into one last dimension."""
    if input.dim() == 0:
        return input.reshape(1), None if mask is None else mask.reshape(1)
    ends = list(range(input.dim() - len(dims), input.dim()))
    if dims == ends:  # already last: no view to build
        x, m = input, mask
    else:
        x = input.movedim(dims, ends)
        m = None if mask is None else mask.movedim(dims, ends)
    if len(dims) > 1:
        x = x.flatten(-len(dims))
        m = None if m is None else m.flatten(-len(dims))
    return x, m


def _normalized_distribution(op, lastdim_op, input, dim, dtype, mask):
    _check_input(op, input)
    if dtype is not None:
        input = input.to(dtype)
        _check_input(op, input)
    dim = _check_dim(op, input, dim)
    mask = _check_mask(op, input, mask)
    x, m = _rows_over(input, mask, [dim])
    out, _ = lastdim_op(x, m)
    if input.dim() == 0:
        return out.reshape(())
    if dim == input.dim() - 1:
        return out
    return out.movedim(-1, dim).contiguous()


def softmax(input, dim, dtype=None, *, mask=None):
    """``torch.softmax`` that is 0 on an all -inf or fully masked row, 1/k on k +inf
    entries, and has finite gradients; ``mask`` (True/nonzero = keep) means
    ``input.masked_fill(~mask, -inf)``."""
    return _normalized_distribution(
        "softmax", torch.ops.nanfree.softmax_lastdim, input, dim, dtype, mask
    )


def log_softmax(input, dim, dtype=None, *, mask=None):
    """``torch.log_softmax`` that is -inf on an all -inf or fully masked row, -log k
    on k +inf entries, and has finite gradients; ``mask`` as in :func:`softmax`."""
    return _normalized_distribution(
        "log_softmax", torch.ops.nanfree.log_softmax_lastdim, input, dim, dtype, mask
    )


def logsumexp(input, dim, keepdim=False, *, mask=None):
    """``torch.logsumexp`` over ``dim`` (an int or a sequence of ints): -inf for an
    empty or fully masked set, +inf if an entry is +inf, gradient 0 for both."""
    _check_input("logsumexp", input)
    dims = [dim] if isinstance(dim, int) and not isinstance(dim, bool) else dim
    if not isinstance(dims, Sequence) or isinstance(dims, str) or len(dims) == 0:
        raise TypeError(
            f"nanfree.logsumexp: `dim` must be an int or a non-empty sequence of ints, got {dim!r}"
        )
    dims = [_check_dim("logsumexp", input, d) for d in dims]
    if len(set(dims)) != len(dims):
        raise ValueError(f"nanfree.logsumexp: `dim` {tuple(dim)} names a dimension twice")
    mask = _check_mask("logsumexp", input, mask)
    x, m = _rows_over(input, mask, dims)
    out, _ = torch.ops.nanfree.logsumexp_lastdim(x, m)
    if keepdim and input.dim() > 0:
        for d in sorted(dims):
            out = out.unsqueeze(d)
    return out
