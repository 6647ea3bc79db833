"""The reduction layout shared by the families in Python (softmax, GeM, and
normalize's dims): a tensor reduced over some of its dims seen as
[outer, n, inner] (the reduced dims as one middle dim), and a mask of the
input's shape described as the kernels read it (MaskView in
csrc/include/nanfree/layout.h, built like make_mask_view in
csrc/common/softmax_op.h).

Pure torch (no Triton), so nanfree.ops and every Python backend can share it.
"""

import math
import numbers
from collections.abc import Sequence

import torch

from .common import wrap_dim as _wrap_dim


def wrap_reduced_dim(op, t, dim):
    """`dim` in [0, rank) (a 0-d tensor counts as one dimension), else IndexError."""
    return _wrap_dim(op, dim, max(t.dim(), 1), t.dim())


def reduced_dims(op, t, dim):
    """The reduced dims of an int or a non-empty sequence of ints (numpy's
    integers too, as torch takes them), wrapped and sorted; TypeError for
    anything else, ValueError for a repeated dim."""
    def is_int(d):
        return isinstance(d, numbers.Integral) and not isinstance(d, bool)

    if not (is_int(dim) or isinstance(dim, Sequence)) or isinstance(dim, str):
        raise TypeError(f"nanfree.{op}: `dim` must be an int or a non-empty sequence of ints, "
                        f"got {dim!r}")
    dims = [dim] if is_int(dim) else list(dim)
    if not dims or not all(is_int(d) for d in dims):
        raise TypeError(f"nanfree.{op}: `dim` must be an int or a non-empty sequence of ints, "
                        f"got {dim!r}")
    wrapped = sorted(wrap_reduced_dim(op, t, int(d)) for d in dims)
    if len(set(wrapped)) != len(wrapped):
        raise ValueError(f"nanfree.{op}: `dim` {tuple(dims)} names a dimension twice")
    return wrapped


def consecutive(dims):
    return all(b == a + 1 for a, b in zip(dims, dims[1:]))


def problem_shape(t, dim):
    """(outer, n, inner) of a tensor reduced over `dim` (ReductionLayout of layout.h)."""
    if t.dim() == 0:
        return 1, 1, 1
    return math.prod(t.shape[:dim]), t.shape[dim], math.prod(t.shape[dim + 1:])


def reduction_view(t, dims):
    """t as [outer, n, inner] reduced over n, the sorted `dims` (reduced_dims):
    a view when the dims are adjacent and t's layout allows; otherwise they are
    moved last (a copy, inner 1)."""
    if t.dim() == 0:
        return t.reshape(1, 1, 1)
    if consecutive(dims):
        first, last, shape = dims[0], dims[-1], t.shape
        return t.reshape(math.prod(shape[:first]), math.prod(shape[first:last + 1]),
                         math.prod(shape[last + 1:]))
    kept = [d for d in range(t.dim()) if d not in dims]
    moved = t.permute(*kept, *dims)
    return moved.reshape(math.prod(moved.shape[:len(kept)]), -1, 1)


def reduced_shape(t, dims, keepdim):
    """The shape of a reduction of t over the sorted `dims`."""
    if t.dim() == 0:
        return ()
    shape = [1 if d in dims else size for d, size in enumerate(t.shape)]
    return shape if keepdim else [size for d, size in enumerate(shape) if d not in dims]


def _collapse(mask: torch.Tensor):
    """Leading dims of `mask` without size-1 dims, adjacent row-major ones merged."""
    sizes, strides = [], []
    for size, stride in zip(mask.shape[:-1], mask.stride()[:-1]):
        if size == 1:
            continue
        if sizes and strides[-1] == stride * size:
            sizes[-1] *= size
            strides[-1] = stride
        else:
            sizes.append(size)
            strides.append(stride)
    return sizes, strides


def mask_layout(mask: torch.Tensor, dim: int = -1):
    """Describe a mask of the input's shape (any strides, 0 for broadcast),
    reduced over `dim`.

    The reduced dim is moved last (a view), so row r = o * inner + i of the
    [outer, cols, inner] problem is the row-major index over the other dims.
    Returns (mask_tensor, sizes3, strides3, col_stride): row r starts at
    element offset i0 * strides3[0] + i1 * strides3[1] + i2 * strides3[2] of
    mask_tensor, with r split row-major as (i0, i1, i2) over sizes3, and
    column j adds j * col_stride. The mask is copied (made contiguous, with
    `dim` last) only when its other dims do not collapse to three.
    """
    if mask.dim() == 0:
        return mask, (1, 1, 1), (0, 0, 0), 0
    mask = mask.movedim(dim, -1)
    sizes, strides = _collapse(mask)
    if len(sizes) > 3:
        mask = mask.contiguous()
        sizes, strides = _collapse(mask)
    pad = 3 - len(sizes)
    sizes3 = (1,) * pad + tuple(sizes)
    strides3 = (0,) * pad + tuple(strides)
    return mask, sizes3, strides3, mask.stride(-1)
