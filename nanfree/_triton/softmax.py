"""Triton backend of softmax / log_softmax / logsumexp over the last dimension.

The per-entry math mirrors csrc/include/nanfree/softmax_math.h function by
function (same names); the row reduction uses the online logsumexp state of
numerics.py. One program handles one row: a row of at most MAX_FUSED_COLS
entries is loaded once and kept in registers, a longer one is streamed in
blocks of LOOP_BLOCK columns twice (state, then outputs).

Each forward also returns the row statistics the backward uses (RowStats in
softmax_math.h): a contiguous tensor of shape input.shape[:-1] + [2] holding
(max, log(sum(exp(x - max)))), float32 (float64 for float64 input).
"""

from contextlib import nullcontext

import torch
import triton
import triton.language as tl

from .._mask_layout import mask_layout
from .._softmax_checks import acc_dtype, check_backward, check_float, check_mask
from .numerics import lse_block_state, lse_merge, lse_scale, lse_value

# Forward modes (kernel constexpr).
SOFTMAX = tl.constexpr(0)
LOG_SOFTMAX = tl.constexpr(1)
LOGSUMEXP = tl.constexpr(2)

# Block policy (module attributes, so tests may shrink them to reach the loop).
MAX_FUSED_COLS = 8192
LOOP_BLOCK = 4096


# ---------------------------------------------------------------------------
# Mirror of softmax_math.h
# ---------------------------------------------------------------------------


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
def softmax_grad_value(g, y, dot):
    return y * (g - dot)


@triton.jit
def log_softmax_grad_value(g, y, grad_sum, keep):
    # exp(-inf) = 0: an unmasked -inf entry receives g; a dropped entry receives 0.
    return tl.where(keep, g - tl.exp(y) * grad_sum, 0.0)


@triton.jit
def logsumexp_grad_value(g, x, row_max, log_sum, keep):
    # A dropped entry (its x may be NaN) receives 0; an unmasked -inf gets exp(-inf) = 0.
    return tl.where(keep, g * tl.exp((x - row_max) - log_sum), 0.0)


# ---------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------


@triton.jit
def _load_keep(mask_row, mask_col_stride, cols, n_cols, HAS_MASK: tl.constexpr):
    """Which columns of this block are real (in the row) and kept by the mask."""
    keep = cols < n_cols
    if HAS_MASK:
        keep = keep & (tl.load(mask_row + cols * mask_col_stride, mask=keep, other=0) != 0)
    return keep


@triton.jit
def _load_logits(x_row, mask_row, mask_col_stride, cols, n_cols, ACC: tl.constexpr,
                 HAS_MASK: tl.constexpr):
    """A block of masked_value(x, keep) in the accumulation dtype (-inf past the row)."""
    keep = _load_keep(mask_row, mask_col_stride, cols, n_cols, HAS_MASK)
    x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(ACC)
    return masked_value(x, keep)


@triton.jit
def _mask_row(mask_ptr, row, ms1, ms2, mst0, mst1, mst2, HAS_MASK: tl.constexpr):
    if HAS_MASK:
        return mask_ptr + mask_row_offset(row, ms1, ms2, mst0, mst1, mst2)
    else:
        return mask_ptr


@triton.jit
def _output_value(x, row_max, aux, MODE: tl.constexpr):
    if MODE == SOFTMAX:
        return softmax_value(x, row_max, aux)
    else:
        return log_softmax_value(x, row_max, aux)


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

    x = _load_logits(x_row, mask_row, mask_col_stride, cols, n_cols, ACC, HAS_MASK)
    row_max, row_sum = lse_block_state(x)
    if not SINGLE_BLOCK:
        for start in range(BLOCK, n_cols, BLOCK):
            xb = _load_logits(x_row, mask_row, mask_col_stride, start + cols, n_cols, ACC,
                              HAS_MASK)
            block_max, block_sum = lse_block_state(xb)
            row_max, row_sum = lse_merge(row_max, row_sum, block_max, block_sum)
    row_max, log_sum = row_stats(row_max, row_sum)
    tl.store(stats_ptr + 2 * row, row_max)
    tl.store(stats_ptr + 2 * row + 1, log_sum)

    if MODE == LOGSUMEXP:
        tl.store(out_ptr + row, lse_value(row_max, row_sum).to(out_ptr.dtype.element_ty))
    else:
        if MODE == SOFTMAX:
            aux = 1.0 / row_sum  # inf for an empty row, which softmax_value never uses
        else:
            aux = log_sum
        out_ty = out_ptr.dtype.element_ty
        if SINGLE_BLOCK:
            y = _output_value(x, row_max, aux, MODE)
            tl.store(out_row + cols, y.to(out_ty), mask=cols < n_cols)
        else:
            for start in range(0, n_cols, BLOCK):
                xb = _load_logits(x_row, mask_row, mask_col_stride, start + cols, n_cols, ACC,
                                  HAS_MASK)
                y = _output_value(xb, row_max, aux, MODE)
                tl.store(out_row + start + cols, y.to(out_ty), mask=start + cols < n_cols)


@triton.jit
def _row_sum_term(g, y, keep, MODE: tl.constexpr):
    """What the backward sums over a row: g * y for softmax (a dropped entry has
    y = 0), the kept g for log_softmax."""
    if MODE == SOFTMAX:
        return g * y
    else:
        return tl.where(keep, g, 0.0)


@triton.jit
def _grad_value(g, y, row_sum, keep, MODE: tl.constexpr):
    if MODE == SOFTMAX:
        return softmax_grad_value(g, y, row_sum)
    else:
        return log_softmax_grad_value(g, y, row_sum, keep)


@triton.jit
def _softmax_backward_kernel(go_ptr, y_ptr, stats_ptr, gi_ptr, mask_ptr, n_cols,
                             ms1, ms2, mst0, mst1, mst2, mask_col_stride,
                             HAS_MASK: tl.constexpr, BLOCK: tl.constexpr,
                             SINGLE_BLOCK: tl.constexpr, MODE: tl.constexpr):
    """Backward of softmax (MODE SOFTMAX, called without a mask) or log_softmax
    (MODE LOG_SOFTMAX) from the output y: a row sum, then one value per entry."""
    ACC: tl.constexpr = stats_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    go_row = go_ptr + row * n_cols
    y_row = y_ptr + row * n_cols
    gi_row = gi_ptr + row * n_cols
    mask_row = _mask_row(mask_ptr, row, ms1, ms2, mst0, mst1, mst2, HAS_MASK)
    has_grad = row_has_gradient(tl.load(stats_ptr + 2 * row), tl.load(stats_ptr + 2 * row + 1))
    cols = tl.arange(0, BLOCK)
    out_ty = gi_ptr.dtype.element_ty
    if SINGLE_BLOCK:
        inside = cols < n_cols
        keep = _load_keep(mask_row, mask_col_stride, cols, n_cols, HAS_MASK)
        g = tl.load(go_row + cols, mask=inside, other=0.0).to(ACC)
        y = tl.load(y_row + cols, mask=inside, other=0.0).to(ACC)
        row_sum = tl.sum(_row_sum_term(g, y, keep, MODE), axis=0)
        grad = _grad_value(g, y, row_sum, keep, MODE)
        tl.store(gi_row + cols, tl.where(has_grad, grad, 0.0).to(out_ty), mask=inside)
    else:
        partial = tl.zeros([BLOCK], dtype=ACC)
        for start in range(0, n_cols, BLOCK):
            inside = start + cols < n_cols
            keep = _load_keep(mask_row, mask_col_stride, start + cols, n_cols, HAS_MASK)
            g = tl.load(go_row + start + cols, mask=inside, other=0.0).to(ACC)
            y = tl.load(y_row + start + cols, mask=inside, other=0.0).to(ACC)
            partial += _row_sum_term(g, y, keep, MODE)
        row_sum = tl.sum(partial, axis=0)
        for start in range(0, n_cols, BLOCK):
            inside = start + cols < n_cols
            keep = _load_keep(mask_row, mask_col_stride, start + cols, n_cols, HAS_MASK)
            g = tl.load(go_row + start + cols, mask=inside, other=0.0).to(ACC)
            y = tl.load(y_row + start + cols, mask=inside, other=0.0).to(ACC)
            grad = _grad_value(g, y, row_sum, keep, MODE)
            tl.store(gi_row + start + cols, tl.where(has_grad, grad, 0.0).to(out_ty),
                     mask=inside)


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
    out_ty = gi_ptr.dtype.element_ty
    for start in range(0, n_cols, BLOCK):
        inside = start + cols < n_cols
        keep = _load_keep(mask_row, mask_col_stride, start + cols, n_cols, HAS_MASK)
        x = tl.load(x_row + start + cols, mask=inside, other=0.0).to(ACC)
        grad = logsumexp_grad_value(g, x, row_max, log_sum, keep)
        tl.store(gi_row + start + cols, tl.where(has_grad, grad, 0.0).to(out_ty), mask=inside)


# ---------------------------------------------------------------------------
# Launchers (the op implementations; the last dim is the reduced one)
# ---------------------------------------------------------------------------


def _block_config(n_cols):
    """(BLOCK, SINGLE_BLOCK, num_warps) for rows of n_cols >= 1 entries."""
    if n_cols <= MAX_FUSED_COLS:
        block, single = triton.next_power_of_2(n_cols), True
    else:
        block, single = LOOP_BLOCK, False
    # At most 8 elements per thread before the 16-warp cap; 1 warp for short rows.
    num_warps = min(max(block // 256, 1), 16)
    return block, single, num_warps


def _device_guard(t):
    return torch.cuda.device(t.device) if t.is_cuda else nullcontext()


def _rows(x):
    n = 1
    for size in x.shape[:-1]:
        n *= size
    return n


def _mask_args(mask, x):
    """(tensor, sizes3, strides3, col_stride, has_mask) for the kernels."""
    if mask is None:
        return x, (1, 1, 1), (0, 0, 0), 0, False
    m, sizes, strides, col_stride = mask_layout(mask)
    return m.view(torch.uint8), sizes, strides, col_stride, True


def _as_row(t):
    return None if t is None else t.reshape(1)


def _forward(input, mask, mode, op):
    check_float(op, "input", input)
    check_mask(op, input, mask)
    if input.dim() == 0:  # one row of one entry
        out, stats = _forward(input.reshape(1), _as_row(mask), mode, op)
        return (out if mode == LOGSUMEXP else out.reshape(())), stats
    x = input.contiguous()
    n_rows, n_cols = _rows(x), x.shape[-1]
    stats = torch.empty((*x.shape[:-1], 2), dtype=acc_dtype(x.dtype), device=x.device)
    out = torch.empty(x.shape[:-1] if mode == LOGSUMEXP else x.shape, dtype=x.dtype,
                      device=x.device)
    m, sizes, strides, col_stride, has_mask = _mask_args(mask, x)
    if n_rows == 0:
        return out, stats
    if n_cols == 0:  # the empty set: max -inf, log_sum log(0); softmax outputs are empty
        stats.fill_(float("-inf"))
        out.fill_(float("-inf"))
        return out, stats
    block, single, num_warps = _block_config(n_cols)
    with _device_guard(x):
        _forward_kernel[(n_rows,)](
            x, out, stats, m, n_cols, sizes[1], sizes[2], strides[0], strides[1], strides[2],
            col_stride, MODE=mode, HAS_MASK=has_mask, BLOCK=block, SINGLE_BLOCK=single,
            num_warps=num_warps)
    return out, stats


def softmax_lastdim(input, mask=None):
    """softmax over the last dim, dropped entries (mask False) as -inf -> (output, stats)."""
    return _forward(input, mask, SOFTMAX, "softmax")


def log_softmax_lastdim(input, mask=None):
    """log_softmax over the last dim -> (output, stats)."""
    return _forward(input, mask, LOG_SOFTMAX, "log_softmax")


def logsumexp_lastdim(input, mask=None):
    """logsumexp over the last dim -> (output of shape input.shape[:-1], stats)."""
    return _forward(input, mask, LOGSUMEXP, "logsumexp")


def _backward(op, kernel, grad_output, saved, stats, mask, per_row_grad, **meta):
    """Checks the operands and launches one backward kernel program per row.

    ``saved`` is the forward's output (softmax, log_softmax) or input
    (logsumexp); ``per_row_grad`` says grad_output has one value per row."""
    grad_shape = saved.shape[:-1] if per_row_grad else saved.shape
    check_backward(op, grad_output, saved, stats, mask, grad_shape)
    if saved.dim() == 0:  # one row of one entry
        row = saved.reshape(1)
        g = grad_output.reshape(row.shape[:-1] if per_row_grad else row.shape)
        return _backward(op, kernel, g, row, stats, _as_row(mask), per_row_grad,
                         **meta).reshape(())
    g, saved, stats = grad_output.contiguous(), saved.contiguous(), stats.contiguous()
    grad_input = torch.empty(saved.shape, dtype=saved.dtype, device=saved.device)
    n_rows, n_cols = _rows(saved), saved.shape[-1]
    if n_rows == 0 or n_cols == 0:
        return grad_input
    block, single, num_warps = _block_config(n_cols)
    m, sizes, strides, col_stride, has_mask = _mask_args(mask, saved)
    with _device_guard(saved):
        kernel[(n_rows,)](
            g, saved, stats, grad_input, m, n_cols, sizes[1], sizes[2], strides[0], strides[1],
            strides[2], col_stride, HAS_MASK=has_mask, BLOCK=block, SINGLE_BLOCK=single,
            num_warps=num_warps, **meta)
    return grad_input


def softmax_lastdim_backward(grad_output, output, stats):
    """y * (g - sum(g * y)); 0 for rows without gradient."""
    return _backward("softmax_backward", _softmax_backward_kernel, grad_output, output, stats,
                     None, per_row_grad=False, MODE=SOFTMAX)


def log_softmax_lastdim_backward(grad_output, output, stats, mask=None):
    """g - exp(y) * sum(kept g); 0 where dropped and for rows without gradient."""
    return _backward("log_softmax_backward", _softmax_backward_kernel, grad_output, output,
                     stats, mask, per_row_grad=False, MODE=LOG_SOFTMAX)


def logsumexp_lastdim_backward(grad_output, input, stats, mask=None):
    """g * softmax(x) (grad_output of shape input.shape[:-1]); 0 where dropped."""
    return _backward("logsumexp_backward", _logsumexp_backward_kernel, grad_output, input,
                     stats, mask, per_row_grad=True)
