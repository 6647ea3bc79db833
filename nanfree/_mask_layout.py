"""The [rows, cols] layout of a softmax mask, as MaskView in softmax_math.h
(built like make_mask_view in csrc/common/softmax_op.h).

Pure torch (no Triton), so every Python backend can share it.
"""

import torch


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
