"""The [rows, cols] layout of a softmax mask, as MaskView in softmax_math.h.

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


def mask_layout(mask: torch.Tensor):
    """Describe a mask of the input's shape (any strides, 0 for broadcast).

    Returns (mask_tensor, sizes3, strides3, col_stride): row r of the
    [rows, cols] problem starts at element offset
    i0 * strides3[0] + i1 * strides3[1] + i2 * strides3[2] of mask_tensor, with
    r split row-major as (i0, i1, i2) over sizes3, and column j adds
    j * col_stride. The mask is copied (made contiguous) only when its leading
    dims do not collapse to three.
    """
    if mask.dim() == 0:
        return mask, (1, 1, 1), (0, 0, 0), 0
    sizes, strides = _collapse(mask)
    if len(sizes) > 3:
        mask = mask.contiguous()
        sizes, strides = _collapse(mask)
    pad = 3 - len(sizes)
    sizes3 = (1,) * pad + tuple(sizes)
    strides3 = (0,) * pad + tuple(strides)
    return mask, sizes3, strides3, mask.stride(-1)
