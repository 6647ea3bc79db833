"""Triton backend of the softmax family: softmax / log_softmax / logsumexp over
one dimension, and their backward ops.

One function per op, named and called as the ``nanfree::`` op
(csrc/registration.cpp), with the argument checks of
nanfree/_ops/softmax.py. The per-entry math mirrors
csrc/include/nanfree/softmax_math.h function by function (same names); the row
reduction uses the online logsumexp state of numerics.py.

The contiguous input is viewed as [outer, cols, inner] (ReductionLayout) and
reduced over cols; row r = o * inner + i holds the entries (o, j, i) at
element offset (o * cols + j) * inner + i (entry_offset).

- inner == 1 (the last dim): one program per row. A row of at most
  MAX_FUSED_COLS entries is loaded once and kept in registers, a longer one is
  streamed in blocks of LOOP_BLOCK columns twice (state, then outputs).
- inner > 1 (a strided dim), reduced in place (no movedim, no copy of a
  contiguous tensor): one program per (o, block of BLOCK_I consecutive i),
  loading tiles [BLOCK_J, BLOCK_I] that are contiguous along i (coalesced).
  The forward keeps one online (max, sum) state per column i, merged tile by
  tile with lse_merge, then writes the outputs in a second loop over the
  tiles; a row that fits one tile (cols <= BLOCK_J) is loaded once. The
  softmax / log_softmax backward loops over the tiles twice (row sums, then
  gradients); the logsumexp backward is elementwise, one loop over the tiles.
  BLOCK_I is min(next_pow2(inner), STRIDED_BLOCK_I), BLOCK_J is
  min(next_pow2(cols), STRIDED_TILE // BLOCK_I).

Each forward also returns the row statistics the backward uses (RowStats in
softmax_math.h): the input's shape with `dim` of size 2 holding
(max, log(sum(exp(x - max)))) along it (stats_offset), float32 (float64 for
float64 input).

The kernels run where the Triton of this process can run them: CPU tensors
when they were defined under Triton's interpreter (TRITON_INTERPRET=1), CUDA
tensors when compiled; any other tensor is refused with
BackendUnavailableError before anything is launched (common.py).
"""

import torch
import triton
import triton.language as tl

from .._ops.common import acc_dtype
from .._ops.layout import mask_layout, problem_shape
from .._ops.softmax import check_backward, check_forward, row_shape, stats_shape
from . import common
from .common import device_guard
from .element_io import store_rounded, store_saturated, widen
from .numerics import (GRAD_SUM_SCALE, GRAD_SUM_UNSCALE, grad_sum_overflowed, largest_finite,
                       lse_block_state, lse_merge, lse_scale, lse_tile_state_axis0, lse_value,
                       saturate)

# Forward modes (kernel constexpr).
SOFTMAX = tl.constexpr(0)
LOG_SOFTMAX = tl.constexpr(1)
LOGSUMEXP = tl.constexpr(2)

# Block policy (module attributes, so tests may shrink them to reach the loops).
# Last dim (inner == 1):
MAX_FUSED_COLS = 8192
LOOP_BLOCK = 4096
# Strided dim (inner > 1): consecutive i per program, elements per tile.
STRIDED_BLOCK_I = 64
STRIDED_TILE = 4096


# ---------------------------------------------------------------------------
# Mirror of softmax_math.h
# ---------------------------------------------------------------------------


@triton.jit
def entry_offset(o, j, i, n_cols, inner):
    """Element offset of entry (o, j, i) of the [outer, cols, inner] view."""
    return (o * n_cols + j) * inner + i


@triton.jit
def stats_offset(o, k, i, inner):
    """Element offset of the statistic k (0: max, 1: log_sum) of row (o, i)."""
    return (o * 2 + k) * inner + i


@triton.jit
def mask_row_offset(row, size1, size2, stride0, stride1, stride2):
    """Element offset of row `row` in a MaskView (row split row-major over 3 dims)."""
    i2 = row % size2
    row = row // size2
    i1 = row % size1
    i0 = row // size1
    return i0 * stride0 + i1 * stride1 + i2 * stride2


@triton.jit
def masked_value(x, keep):
    # A dropped entry is exactly -inf, whatever it held (NaN included).
    return tl.where(keep, x, float("-inf"))


@triton.jit
def softmax_value(x, row_max, inv_sum):
    # An empty row (all -inf or all masked) is the empty distribution: 0, not 0/0.
    # A row of NaN and -inf only also has max -inf but a NaN sum: it stays NaN.
    empty = (row_max == float("-inf")) & (inv_sum == inv_sum)
    # lse_scale gives 1 at x == max, so k entries +inf give 1/k, the rest exp(-inf) = 0.
    return tl.where(empty, 0.0, lse_scale(x, row_max) * inv_sum)


@triton.jit
def log_softmax_value(x, row_max, log_sum):
    # An empty row is -inf everywhere instead of -inf - (-inf) = NaN; a row of NaN
    # and -inf only (max -inf, NaN sum) is not empty and stays NaN.
    empty = (row_max == float("-inf")) & (log_sum == log_sum)
    # x == max also covers +inf entries of a +inf row (x - max = NaN): limit -log k.
    shifted = tl.where(x == row_max, -log_sum, (x - row_max) - log_sum)
    return tl.where(empty, float("-inf"), shifted)


@triton.jit
def row_stats(row_max, row_sum):
    """(max, log_sum) saved per row: apart, since max + log_sum may overflow."""
    return row_max, tl.log(row_sum)


@triton.jit
def row_has_gradient(row_max, log_sum):
    # An empty row (max -inf) and a row holding +inf (max +inf) are locally
    # constant: gradient 0. A NaN row (NaN log_sum, whatever its max) passes NaN on.
    return ((row_max != float("inf")) & (row_max != float("-inf"))) | (log_sum != log_sum)


@triton.jit
def softmax_grad_value(g, y, dot, bound):
    d = g - dot
    # g - dot past the range: y * (g - dot) may be small or 0 (y = 0 would give
    # 0 * inf = NaN), formed at half scale (the same value where g or dot is inf).
    halved = 2.0 * (y * (0.5 * g - 0.5 * dot))
    return saturate(tl.where(tl.abs(d) == float("inf"), halved, y * d), bound)


@triton.jit
def log_softmax_grad_value(g, y, plain, scaled, keep, bound):
    # exp(-inf) = 0: an unmasked -inf entry receives g; a dropped entry receives 0.
    p = tl.exp(y)
    ps = p * scaled
    # Where the plain sum overflowed: at the scale 2^-64 (p * sum 0 receives g).
    at_scale = tl.where(ps == 0.0, g, (g * GRAD_SUM_SCALE - ps) * GRAD_SUM_UNSCALE)
    grad = tl.where(grad_sum_overflowed(plain, scaled), at_scale, g - p * plain)
    return tl.where(keep, saturate(grad, bound), 0.0)


@triton.jit
def logsumexp_grad_value(g, x, row_max, log_sum, keep):
    # A dropped entry (its x may be NaN) receives 0; an unmasked -inf gets exp(-inf) = 0.
    return tl.where(keep, g * tl.exp((x - row_max) - log_sum), 0.0)


# ---------------------------------------------------------------------------
# Helpers shared by the kernels (no special-value rule in here)
# ---------------------------------------------------------------------------


@triton.jit
def _mask_row(mask_ptr, row, ms1, ms2, mst0, mst1, mst2, HAS_MASK: tl.constexpr):
    """Pointer(s) to the mask of row(s) `row` (a scalar or a [BLOCK_I] vector)."""
    if HAS_MASK:
        return mask_ptr + mask_row_offset(row, ms1, ms2, mst0, mst1, mst2)
    else:
        return mask_ptr


@triton.jit
def _load_keep(mask_row, mask_col_stride, cols, inside, HAS_MASK: tl.constexpr):
    """Which entries are real (`inside` the problem) and kept by the mask; `cols`
    broadcasts against mask_row: a 1-D block of one row, or a [BLOCK_J, 1]
    column against a [1, BLOCK_I] set of rows."""
    keep = inside
    if HAS_MASK:
        col_offs = cols.to(tl.int64) * mask_col_stride  # past 2**31 for a huge transposed mask
        keep = keep & (tl.load(mask_row + col_offs, mask=inside, other=0) != 0)
    return keep


@triton.jit
def _load_logits(x_ptrs, mask_row, mask_col_stride, cols, inside, ACC: tl.constexpr,
                 HAS_MASK: tl.constexpr):
    """masked_value(x, keep) in the accumulation dtype (-inf outside the problem)."""
    keep = _load_keep(mask_row, mask_col_stride, cols, inside, HAS_MASK)
    x = widen(x_ptrs, 0, inside).to(ACC)
    return masked_value(x, keep)


@triton.jit
def _output_value(x, row_max, aux, MODE: tl.constexpr):
    if MODE == SOFTMAX:
        return softmax_value(x, row_max, aux)
    else:
        return log_softmax_value(x, row_max, aux)


@triton.jit
def _output_aux(row_sum, log_sum, MODE: tl.constexpr):
    """What _output_value needs besides the max: 1 / sum (softmax) or log_sum."""
    if MODE == SOFTMAX:
        return 1.0 / row_sum  # inf for an empty row, which softmax_value never uses
    else:
        return log_sum


@triton.jit
def _row_sum_term(g, y, keep, MODE: tl.constexpr):
    """What the backward sums over a row: g * y for softmax (a dropped entry has
    y = 0), the kept g for log_softmax."""
    if MODE == SOFTMAX:
        return g * y
    else:
        return tl.where(keep, g, 0.0)


@triton.jit
def _grad_value(g, y, row_sum, row_sum_scaled, keep, bound, MODE: tl.constexpr):
    if MODE == SOFTMAX:
        return softmax_grad_value(g, y, row_sum, bound)
    else:
        return log_softmax_grad_value(g, y, row_sum, row_sum_scaled, keep, bound)


@triton.jit
def _scaled_row_sum(term, axis, MODE: tl.constexpr):
    """log_softmax's row sum at the scale 2^-64 (read where the plain one
    overflowed); softmax needs none."""
    if MODE == SOFTMAX:
        return tl.sum(term, axis=axis) * 0.0
    else:
        return tl.sum(term * GRAD_SUM_SCALE, axis=axis)


# ---------------------------------------------------------------------------
# Kernels over the last dim (inner == 1): one program per row
# ---------------------------------------------------------------------------


@triton.jit
def _forward_kernel(x_ptr, out_ptr, stats_ptr, mask_ptr, n_cols,
                    ms1, ms2, mst0, mst1, mst2, mask_col_stride,
                    MODE: tl.constexpr, HAS_MASK: tl.constexpr,
                    BLOCK: tl.constexpr, SINGLE_BLOCK: tl.constexpr):
    ACC: tl.constexpr = stats_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * n_cols
    out_row = out_ptr + row * n_cols
    mask_row = _mask_row(mask_ptr, row, ms1, ms2, mst0, mst1, mst2, HAS_MASK)
    cols = tl.arange(0, BLOCK)

    x = _load_logits(x_row + cols, mask_row, mask_col_stride, cols, cols < n_cols, ACC,
                     HAS_MASK)
    row_max, row_sum = lse_block_state(x)
    if not SINGLE_BLOCK:
        for start in range(BLOCK, n_cols, BLOCK):
            c = start + cols
            xb = _load_logits(x_row + c, mask_row, mask_col_stride, c, c < n_cols, ACC, HAS_MASK)
            block_max, block_sum = lse_block_state(xb)
            row_max, row_sum = lse_merge(row_max, row_sum, block_max, block_sum)
    row_max, log_sum = row_stats(row_max, row_sum)
    tl.store(stats_ptr + 2 * row, row_max)
    tl.store(stats_ptr + 2 * row + 1, log_sum)

    if MODE == LOGSUMEXP:
        store_rounded(out_ptr, row, lse_value(row_max, row_sum), None)
    else:
        aux = _output_aux(row_sum, log_sum, MODE)
        if SINGLE_BLOCK:
            y = _output_value(x, row_max, aux, MODE)
            store_rounded(out_row, cols, y, cols < n_cols)
        else:
            for start in range(0, n_cols, BLOCK):
                c = start + cols
                xb = _load_logits(x_row + c, mask_row, mask_col_stride, c, c < n_cols, ACC,
                                  HAS_MASK)
                y = _output_value(xb, row_max, aux, MODE)
                store_rounded(out_row, c, y, c < n_cols)


@triton.jit
def _softmax_backward_kernel(go_ptr, y_ptr, stats_ptr, gi_ptr, mask_ptr, n_cols,
                             ms1, ms2, mst0, mst1, mst2, mask_col_stride,
                             HAS_MASK: tl.constexpr, BLOCK: tl.constexpr,
                             SINGLE_BLOCK: tl.constexpr, MODE: tl.constexpr):
    """Backward of softmax (MODE SOFTMAX, called without a mask) or log_softmax
    (MODE LOG_SOFTMAX) from the output y: a row sum, then one value per entry."""
    ACC: tl.constexpr = stats_ptr.dtype.element_ty
    bound = largest_finite(gi_ptr)
    row = tl.program_id(0).to(tl.int64)
    go_row = go_ptr + row * n_cols
    y_row = y_ptr + row * n_cols
    gi_row = gi_ptr + row * n_cols
    mask_row = _mask_row(mask_ptr, row, ms1, ms2, mst0, mst1, mst2, HAS_MASK)
    has_grad = row_has_gradient(tl.load(stats_ptr + 2 * row), tl.load(stats_ptr + 2 * row + 1))
    cols = tl.arange(0, BLOCK)
    if SINGLE_BLOCK:
        inside = cols < n_cols
        keep = _load_keep(mask_row, mask_col_stride, cols, inside, HAS_MASK)
        g = widen(go_row, cols, inside).to(ACC)
        y = widen(y_row, cols, inside).to(ACC)
        term = _row_sum_term(g, y, keep, MODE)
        row_sum = tl.sum(term, axis=0)
        grad = _grad_value(g, y, row_sum, _scaled_row_sum(term, 0, MODE), keep, bound, MODE)
        # row_has_gradient: an empty or +inf row gets 0 (its formula may give g or NaN).
        store_saturated(gi_row, cols, tl.where(has_grad, grad, 0.0), inside)
    else:
        partial = tl.zeros([BLOCK], dtype=ACC)
        partial_scaled = tl.zeros([BLOCK], dtype=ACC)
        for start in range(0, n_cols, BLOCK):
            c = start + cols
            inside = c < n_cols
            keep = _load_keep(mask_row, mask_col_stride, c, inside, HAS_MASK)
            g = widen(go_row, c, inside).to(ACC)
            y = widen(y_row, c, inside).to(ACC)
            term = _row_sum_term(g, y, keep, MODE)
            partial += term
            if MODE != SOFTMAX:
                partial_scaled += term * GRAD_SUM_SCALE
        row_sum = tl.sum(partial, axis=0)
        row_sum_scaled = tl.sum(partial_scaled, axis=0)
        for start in range(0, n_cols, BLOCK):
            c = start + cols
            inside = c < n_cols
            keep = _load_keep(mask_row, mask_col_stride, c, inside, HAS_MASK)
            g = widen(go_row, c, inside).to(ACC)
            y = widen(y_row, c, inside).to(ACC)
            grad = _grad_value(g, y, row_sum, row_sum_scaled, keep, bound, MODE)
            # row_has_gradient: an empty or +inf row gets 0 (its formula may give g or NaN).
            store_saturated(gi_row, c, tl.where(has_grad, grad, 0.0), inside)


@triton.jit
def _logsumexp_backward_kernel(go_ptr, x_ptr, stats_ptr, gi_ptr, mask_ptr, n_cols,
                               ms1, ms2, mst0, mst1, mst2, mask_col_stride,
                               HAS_MASK: tl.constexpr, BLOCK: tl.constexpr,
                               SINGLE_BLOCK: tl.constexpr):
    # One pass whatever the row length (SINGLE_BLOCK unused): each entry needs only the stats.
    ACC: tl.constexpr = stats_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * n_cols
    gi_row = gi_ptr + row * n_cols
    mask_row = _mask_row(mask_ptr, row, ms1, ms2, mst0, mst1, mst2, HAS_MASK)
    row_max = tl.load(stats_ptr + 2 * row)
    log_sum = tl.load(stats_ptr + 2 * row + 1)
    has_grad = row_has_gradient(row_max, log_sum)
    g = tl.load(go_ptr + row).to(ACC)
    cols = tl.arange(0, BLOCK)
    for start in range(0, n_cols, BLOCK):
        c = start + cols
        inside = c < n_cols
        keep = _load_keep(mask_row, mask_col_stride, c, inside, HAS_MASK)
        x = widen(x_row, c, inside).to(ACC)
        grad = logsumexp_grad_value(g, x, row_max, log_sum, keep)
        # row_has_gradient: an empty or +inf row gets 0 (its formula may give g or NaN).
        store_saturated(gi_row, c, tl.where(has_grad, grad, 0.0), inside)


# ---------------------------------------------------------------------------
# Kernels over a strided dim (inner > 1): one program per (o, BLOCK_I columns i)
# ---------------------------------------------------------------------------


@triton.jit
def _strided_program(n_iblocks, inner, BLOCK_I: tl.constexpr):
    """(o, i, in_row) of this program: its outer index, its BLOCK_I consecutive
    inner indices (int64) and which of them are real."""
    pid = tl.program_id(0).to(tl.int64)
    o = pid // n_iblocks
    i = (pid % n_iblocks) * BLOCK_I + tl.arange(0, BLOCK_I)
    return o, i, i < inner


@triton.jit
def _strided_forward_kernel(x_ptr, out_ptr, stats_ptr, mask_ptr, n_cols, inner, n_iblocks,
                            ms1, ms2, mst0, mst1, mst2, mask_col_stride,
                            MODE: tl.constexpr, HAS_MASK: tl.constexpr,
                            BLOCK_J: tl.constexpr, BLOCK_I: tl.constexpr,
                            SINGLE_TILE: tl.constexpr):
    ACC: tl.constexpr = stats_ptr.dtype.element_ty
    o, i, in_row = _strided_program(n_iblocks, inner, BLOCK_I)
    mask_rows = _mask_row(mask_ptr, o * inner + i, ms1, ms2, mst0, mst1, mst2, HAS_MASK)
    if HAS_MASK:
        mask_rows = mask_rows[None, :]
    js = tl.arange(0, BLOCK_J).to(tl.int64)[:, None]  # [BLOCK_J, 1]
    ii = i[None, :]                                   # [1, BLOCK_I]

    j = js
    inside = (j < n_cols) & (ii < inner)
    offs = entry_offset(o, j, ii, n_cols, inner)
    x = _load_logits(x_ptr + offs, mask_rows, mask_col_stride, j, inside, ACC, HAS_MASK)
    row_max, row_sum = lse_tile_state_axis0(x)
    if not SINGLE_TILE:
        for start in range(BLOCK_J, n_cols, BLOCK_J):
            j = start + js
            inside = (j < n_cols) & (ii < inner)
            offs = entry_offset(o, j, ii, n_cols, inner)
            xt = _load_logits(x_ptr + offs, mask_rows, mask_col_stride, j, inside, ACC,
                              HAS_MASK)
            tile_max, tile_sum = lse_tile_state_axis0(xt)
            row_max, row_sum = lse_merge(row_max, row_sum, tile_max, tile_sum)
    row_max, log_sum = row_stats(row_max, row_sum)
    tl.store(stats_ptr + stats_offset(o, 0, i, inner), row_max, mask=in_row)
    tl.store(stats_ptr + stats_offset(o, 1, i, inner), log_sum, mask=in_row)

    if MODE == LOGSUMEXP:
        store_rounded(out_ptr, o * inner + i, lse_value(row_max, row_sum), in_row)
    else:
        aux = _output_aux(row_sum, log_sum, MODE)[None, :]
        max_b = row_max[None, :]
        if SINGLE_TILE:
            y = _output_value(x, max_b, aux, MODE)
            store_rounded(out_ptr, offs, y, inside)
        else:
            for start in range(0, n_cols, BLOCK_J):
                j = start + js
                inside = (j < n_cols) & (ii < inner)
                offs = entry_offset(o, j, ii, n_cols, inner)
                xt = _load_logits(x_ptr + offs, mask_rows, mask_col_stride, j, inside, ACC,
                                  HAS_MASK)
                y = _output_value(xt, max_b, aux, MODE)
                store_rounded(out_ptr, offs, y, inside)


@triton.jit
def _strided_softmax_backward_kernel(go_ptr, y_ptr, stats_ptr, gi_ptr, mask_ptr, n_cols,
                                     inner, n_iblocks, ms1, ms2, mst0, mst1, mst2,
                                     mask_col_stride, HAS_MASK: tl.constexpr,
                                     BLOCK_J: tl.constexpr, BLOCK_I: tl.constexpr,
                                     SINGLE_TILE: tl.constexpr, MODE: tl.constexpr):
    """_softmax_backward_kernel over a strided dim: row sums per column i, then
    one value per entry."""
    ACC: tl.constexpr = stats_ptr.dtype.element_ty
    bound = largest_finite(gi_ptr)
    o, i, in_row = _strided_program(n_iblocks, inner, BLOCK_I)
    mask_rows = _mask_row(mask_ptr, o * inner + i, ms1, ms2, mst0, mst1, mst2, HAS_MASK)
    if HAS_MASK:
        mask_rows = mask_rows[None, :]
    row_max = tl.load(stats_ptr + stats_offset(o, 0, i, inner), mask=in_row, other=0.0)
    log_sum = tl.load(stats_ptr + stats_offset(o, 1, i, inner), mask=in_row, other=0.0)
    has_grad = row_has_gradient(row_max, log_sum)[None, :]
    js = tl.arange(0, BLOCK_J).to(tl.int64)[:, None]
    ii = i[None, :]
    if SINGLE_TILE:
        inside = (js < n_cols) & (ii < inner)
        offs = entry_offset(o, js, ii, n_cols, inner)
        keep = _load_keep(mask_rows, mask_col_stride, js, inside, HAS_MASK)
        g = widen(go_ptr, offs, inside).to(ACC)
        y = widen(y_ptr, offs, inside).to(ACC)
        term = _row_sum_term(g, y, keep, MODE)
        row_sum = tl.sum(term, axis=0)[None, :]
        row_sum_scaled = _scaled_row_sum(term, 0, MODE)[None, :]
        grad = _grad_value(g, y, row_sum, row_sum_scaled, keep, bound, MODE)
        # row_has_gradient: an empty or +inf row gets 0 (its formula may give g or NaN).
        store_saturated(gi_ptr, offs, tl.where(has_grad, grad, 0.0), inside)
    else:
        partial = tl.zeros([BLOCK_J, BLOCK_I], dtype=ACC)
        partial_scaled = tl.zeros([BLOCK_J, BLOCK_I], dtype=ACC)
        for start in range(0, n_cols, BLOCK_J):
            j = start + js
            inside = (j < n_cols) & (ii < inner)
            offs = entry_offset(o, j, ii, n_cols, inner)
            keep = _load_keep(mask_rows, mask_col_stride, j, inside, HAS_MASK)
            g = widen(go_ptr, offs, inside).to(ACC)
            y = widen(y_ptr, offs, inside).to(ACC)
            term = _row_sum_term(g, y, keep, MODE)
            partial += term
            if MODE != SOFTMAX:
                partial_scaled += term * GRAD_SUM_SCALE
        row_sum = tl.sum(partial, axis=0)[None, :]
        row_sum_scaled = tl.sum(partial_scaled, axis=0)[None, :]
        for start in range(0, n_cols, BLOCK_J):
            j = start + js
            inside = (j < n_cols) & (ii < inner)
            offs = entry_offset(o, j, ii, n_cols, inner)
            keep = _load_keep(mask_rows, mask_col_stride, j, inside, HAS_MASK)
            g = widen(go_ptr, offs, inside).to(ACC)
            y = widen(y_ptr, offs, inside).to(ACC)
            grad = _grad_value(g, y, row_sum, row_sum_scaled, keep, bound, MODE)
            # row_has_gradient: an empty or +inf row gets 0 (its formula may give g or NaN).
            store_saturated(gi_ptr, offs, tl.where(has_grad, grad, 0.0), inside)


@triton.jit
def _strided_logsumexp_backward_kernel(go_ptr, x_ptr, stats_ptr, gi_ptr, mask_ptr, n_cols,
                                       inner, n_iblocks, ms1, ms2, mst0, mst1, mst2,
                                       mask_col_stride, HAS_MASK: tl.constexpr,
                                       BLOCK_J: tl.constexpr, BLOCK_I: tl.constexpr):
    """Elementwise (each entry needs only its row's stats and grad_output), one
    pass over the tiles of this program's columns i: no per-entry division to
    recover (o, j, i) from a flat index."""
    ACC: tl.constexpr = stats_ptr.dtype.element_ty
    o, i, in_row = _strided_program(n_iblocks, inner, BLOCK_I)
    mask_rows = _mask_row(mask_ptr, o * inner + i, ms1, ms2, mst0, mst1, mst2, HAS_MASK)
    if HAS_MASK:
        mask_rows = mask_rows[None, :]
    row_max = tl.load(stats_ptr + stats_offset(o, 0, i, inner), mask=in_row, other=0.0)
    log_sum = tl.load(stats_ptr + stats_offset(o, 1, i, inner), mask=in_row, other=0.0)
    has_grad = row_has_gradient(row_max, log_sum)[None, :]
    g = widen(go_ptr, o * inner + i, in_row).to(ACC)[None, :]
    row_max, log_sum = row_max[None, :], log_sum[None, :]
    js = tl.arange(0, BLOCK_J).to(tl.int64)[:, None]
    ii = i[None, :]
    for start in range(0, n_cols, BLOCK_J):
        j = start + js
        inside = (j < n_cols) & (ii < inner)
        offs = entry_offset(o, j, ii, n_cols, inner)
        keep = _load_keep(mask_rows, mask_col_stride, j, inside, HAS_MASK)
        x = widen(x_ptr, offs, inside).to(ACC)
        grad = logsumexp_grad_value(g, x, row_max, log_sum, keep)
        # row_has_gradient: an empty or +inf row gets 0 (its formula may give g or NaN).
        store_saturated(gi_ptr, offs, tl.where(has_grad, grad, 0.0), inside)


# ---------------------------------------------------------------------------
# Launchers (the op implementations)
# ---------------------------------------------------------------------------


# Every kernel of this module, as defined (tests may monkeypatch the names).
KERNELS = common.KernelSet(_forward_kernel, _softmax_backward_kernel, _logsumexp_backward_kernel,
            _strided_forward_kernel, _strided_softmax_backward_kernel,
            _strided_logsumexp_backward_kernel)
kernels_interpreted = KERNELS.interpreted
_check_runnable = KERNELS.check_runnable


def _block_config(n_cols):
    """(BLOCK, SINGLE_BLOCK, num_warps) for last-dim rows of n_cols >= 1 entries."""
    if n_cols <= MAX_FUSED_COLS:
        block, single = triton.next_power_of_2(n_cols), True
    else:
        block, single = LOOP_BLOCK, False
    # At most 8 elements per thread before the 16-warp cap; 1 warp for short rows.
    num_warps = min(max(block // 256, 1), 16)
    return block, single, num_warps


def _strided_config(n_cols, inner):
    """(BLOCK_J, BLOCK_I, SINGLE_TILE, num_warps) for a strided problem, inner > 1."""
    block_i = min(triton.next_power_of_2(inner), STRIDED_BLOCK_I)
    block_j = min(triton.next_power_of_2(n_cols), max(STRIDED_TILE // block_i, 1))
    # 1 warp per 512 tile entries (16 per thread), between 1 and 8 warps.
    num_warps = min(max(block_j * block_i // 512, 1), 8)
    return block_j, block_i, n_cols <= block_j, num_warps


def _mask_args(mask, dim, x):
    """(tensor, sizes3, strides3, col_stride, has_mask) for the kernels: the
    MaskView of the mask with `dim` moved last."""
    if mask is None:
        return x, (1, 1, 1), (0, 0, 0), 0, False
    m, sizes, strides, col_stride = mask_layout(mask, dim)
    return m.view(torch.uint8), sizes, strides, col_stride, True


def _forward(op, mode, input, dim, mask):
    dim, mask = check_forward(op, input, dim, mask)
    _check_runnable(op, input)
    x = input.contiguous()
    outer, n_cols, inner = problem_shape(x, dim)
    stats = torch.empty(stats_shape(x, dim), dtype=acc_dtype(x.dtype), device=x.device)
    out = torch.empty(row_shape(x, dim) if mode == LOGSUMEXP else x.shape, dtype=x.dtype,
                      device=x.device)
    if outer * inner == 0:
        return out, stats
    if n_cols == 0:  # the empty set: max -inf, log_sum log(0); softmax outputs are empty
        stats.fill_(float("-inf"))
        out.fill_(float("-inf"))
        return out, stats
    m, sizes, strides, col_stride, has_mask = _mask_args(mask, dim, x)
    mask_args = (sizes[1], sizes[2], strides[0], strides[1], strides[2], col_stride)
    with device_guard(x):
        if inner == 1:
            block, single, num_warps = _block_config(n_cols)
            _forward_kernel[(outer,)](
                x, out, stats, m, n_cols, *mask_args, MODE=mode, HAS_MASK=has_mask,
                BLOCK=block, SINGLE_BLOCK=single, num_warps=num_warps, **common.LAUNCH)
        else:
            block_j, block_i, single, num_warps = _strided_config(n_cols, inner)
            n_iblocks = triton.cdiv(inner, block_i)
            _strided_forward_kernel[(outer * n_iblocks,)](
                x, out, stats, m, n_cols, inner, n_iblocks, *mask_args, MODE=mode,
                HAS_MASK=has_mask, BLOCK_J=block_j, BLOCK_I=block_i, SINGLE_TILE=single,
                num_warps=num_warps, **common.LAUNCH)
    return out, stats


def softmax(input, dim, mask=None):
    """softmax over `dim`, dropped entries (mask False) as -inf -> (output, stats)."""
    return _forward("softmax", SOFTMAX, input, dim, mask)


def log_softmax(input, dim, mask=None):
    """log_softmax over `dim` -> (output, stats)."""
    return _forward("log_softmax", LOG_SOFTMAX, input, dim, mask)


def logsumexp(input, dim, mask=None):
    """logsumexp over `dim` -> (output of the input's shape without `dim`, stats)."""
    return _forward("logsumexp", LOGSUMEXP, input, dim, mask)


def _backward(op, grad_output, saved, stats, dim, mask, per_row_grad, mode):
    """Checks the operands and launches the backward kernels.

    ``saved`` is the forward's output (softmax, log_softmax) or input
    (logsumexp); ``per_row_grad`` says grad_output has one value per row."""
    dim, mask = check_backward(op, grad_output, saved, stats, dim, mask, per_row_grad)
    _check_runnable(op, saved)
    g, saved, stats = grad_output.contiguous(), saved.contiguous(), stats.contiguous()
    grad_input = torch.empty(saved.shape, dtype=saved.dtype, device=saved.device)
    outer, n_cols, inner = problem_shape(saved, dim)
    if grad_input.numel() == 0:
        return grad_input
    m, sizes, strides, col_stride, has_mask = _mask_args(mask, dim, saved)
    mask_args = (sizes[1], sizes[2], strides[0], strides[1], strides[2], col_stride)
    with device_guard(saved):
        if inner == 1:
            block, single, num_warps = _block_config(n_cols)
            if mode == LOGSUMEXP:
                _logsumexp_backward_kernel[(outer,)](
                    g, saved, stats, grad_input, m, n_cols, *mask_args, HAS_MASK=has_mask,
                    BLOCK=block, SINGLE_BLOCK=single, num_warps=num_warps, **common.LAUNCH)
            else:
                _softmax_backward_kernel[(outer,)](
                    g, saved, stats, grad_input, m, n_cols, *mask_args, HAS_MASK=has_mask,
                    BLOCK=block, SINGLE_BLOCK=single, MODE=mode, num_warps=num_warps, **common.LAUNCH)
        else:
            block_j, block_i, single, num_warps = _strided_config(n_cols, inner)
            n_iblocks = triton.cdiv(inner, block_i)
            if mode == LOGSUMEXP:
                _strided_logsumexp_backward_kernel[(outer * n_iblocks,)](
                    g, saved, stats, grad_input, m, n_cols, inner, n_iblocks, *mask_args,
                    HAS_MASK=has_mask, BLOCK_J=block_j, BLOCK_I=block_i, num_warps=num_warps, **common.LAUNCH)
            else:
                _strided_softmax_backward_kernel[(outer * n_iblocks,)](
                    g, saved, stats, grad_input, m, n_cols, inner, n_iblocks, *mask_args,
                    HAS_MASK=has_mask, BLOCK_J=block_j, BLOCK_I=block_i, SINGLE_TILE=single,
                    MODE=mode, num_warps=num_warps, **common.LAUNCH)
    return grad_input


def softmax_backward(grad_output, output, stats, dim):
    """y * (g - sum(g * y)); 0 for rows without gradient."""
    return _backward("softmax_backward", grad_output, output, stats, dim, None,
                     per_row_grad=False, mode=SOFTMAX)


def log_softmax_backward(grad_output, output, stats, dim, mask=None):
    """g - exp(y) * sum(kept g); 0 where dropped and for rows without gradient."""
    return _backward("log_softmax_backward", grad_output, output, stats, dim, mask,
                     per_row_grad=False, mode=LOG_SOFTMAX)


def logsumexp_backward(grad_output, input, stats, dim, mask=None):
    """g * softmax(x) (grad_output of the input's shape without `dim`); 0 where dropped."""
    return _backward("logsumexp_backward", grad_output, input, stats, dim, mask,
                     per_row_grad=True, mode=LOGSUMEXP)
