"""The softmax family over one dimension, in plain torch operations.

Mirrors csrc/include/nanfree/softmax_math.h function by function (same names):
the same online (max, sum) state (numerics.py's lse_state) taken over the whole
reduced dimension, and the same special-value rules, written with torch.where. Signatures and results are those of the
``nanfree::softmax`` ops (csrc/registration.cpp).
"""

import torch

from .._ops.softmax import check_backward, check_forward
from .numerics import (INF, acc_dtype, grad_sum_overflowed, grad_sum_scale, grad_sum_unscale,
                       lse_state, lse_value, nf_largest, saturate)

# --- mirror of softmax_math.h (same names, whole rows at once) -------------------


def masked_value(x, keep):
    """A dropped entry is exactly -inf, whatever it held (NaN included)."""
    return x if keep is None else x.masked_fill(~keep, -INF)


def softmax_value(terms, row_max, row_sum):
    """Each entry's softmax from its lse_state term; an empty row is all 0
    rather than 0/0 (a NaN sum stays NaN), k +inf entries get 1/k."""
    empty = (row_max == -INF) & ~torch.isnan(row_sum)
    return torch.where(empty, 0.0, terms / row_sum)


def log_softmax_value(x, row_max, log_sum):
    """-inf for an empty row (a NaN sum stays NaN); -log k on the +inf entries
    of a row holding k of them (x == max, where x - max would be NaN)."""
    empty = (row_max == -INF) & ~torch.isnan(log_sum)
    return torch.where(empty, -INF, torch.where(x == row_max, -log_sum, (x - row_max) - log_sum))


def row_stats(row_max, row_sum, dim):
    """(max, log_sum) along dim, saved for the backward."""
    return torch.cat([row_max, torch.log(row_sum)], dim=dim)


def row_has_gradient(stats, dim):
    """An empty row (max -inf) and a row holding +inf (max +inf) pass no
    gradient; a row holding NaN passes its NaN on."""
    row_max, log_sum = stats.narrow(dim, 0, 1), stats.narrow(dim, 1, 1)
    return ~torch.isinf(row_max) | torch.isnan(log_sum)


def softmax_grad_value(g, y, dot, bound):
    """y * (g - dot), saturated to bound; where g - dot overflows, formed at
    half scale (y = 0 would give 0 * inf = NaN)."""
    d = g - dot
    halved = 2.0 * (y * (0.5 * g - 0.5 * dot))
    return saturate(torch.where(torch.isinf(d), halved, y * d), bound)


def log_softmax_grad_value(g, y, plain, scaled, bound):
    """g - exp(y) * sum of the kept g, saturated to bound; where the plain sum
    overflowed, at the scale 2^-64 (an entry with exp(y) * sum 0 receives g).
    exp(-inf) = 0, so an unmasked -inf entry receives g (dropped entries are
    zeroed by the caller)."""
    p = torch.exp(y)
    ps = p * scaled
    at_scale = torch.where(ps == 0, g, (g * grad_sum_scale() - ps) * grad_sum_unscale())
    return saturate(torch.where(grad_sum_overflowed(plain, scaled), at_scale, g - p * plain), bound)


def logsumexp_grad_value(g, x, stats, dim):
    row_max, log_sum = stats.narrow(dim, 0, 1), stats.narrow(dim, 1, 1)
    return g * torch.exp((x - row_max) - log_sum)


# --- the ops ------------------------------------------------------------------


def _as_rows(t, dim):
    """A 0-d tensor as one row of one entry (dim 0), as the compiled kernels treat it."""
    return (t.reshape(1), 0) if t.dim() == 0 else (t, dim)


def _forward_state(op, input, dim, mask):
    dim, mask = check_forward(op, input, dim, mask)
    x, dim = _as_rows(input, dim)
    mask = None if mask is None else mask.reshape(x.shape)
    x = masked_value(x.to(acc_dtype(input.dtype)), mask)
    row_max, row_sum, terms = lse_state(x, dim)
    return x, dim, row_max, row_sum, terms, row_stats(row_max, row_sum, dim)


def softmax(input, dim, mask=None):
    _, _, row_max, row_sum, terms, stats = _forward_state("softmax", input, dim, mask)
    out = softmax_value(terms, row_max, row_sum)
    return out.to(input.dtype).reshape(input.shape).contiguous(), stats


def log_softmax(input, dim, mask=None):
    x, _, row_max, row_sum, _, stats = _forward_state("log_softmax", input, dim, mask)
    out = log_softmax_value(x, row_max, torch.log(row_sum))
    return out.to(input.dtype).reshape(input.shape).contiguous(), stats


def logsumexp(input, dim, mask=None):
    _, d, row_max, row_sum, _, stats = _forward_state("logsumexp", input, dim, mask)
    out = lse_value(row_max, row_sum).squeeze(d).to(input.dtype)
    return out.reshape(()) if input.dim() == 0 else out, stats


def _backward_rows(op, grad_output, saved, stats, dim, mask, per_row_grad):
    dim, mask = check_backward(op, grad_output, saved, stats, dim, mask, per_row_grad)
    acc = stats.dtype
    s, d = _as_rows(saved, dim)
    g = grad_output.to(acc)
    g = g.reshape(s.shape[:d] + s.shape[d + 1:]).unsqueeze(d) if per_row_grad else g.reshape(s.shape)
    mask = None if mask is None else mask.reshape(s.shape)
    return s.to(acc), g, stats, d, mask


def _finish(dx, stats, dim, mask, saved):
    if mask is not None:
        dx = dx.masked_fill(~mask, 0.0)  # a dropped entry's output is constant
    dx = torch.where(row_has_gradient(stats, dim), dx, 0.0)
    return dx.to(saved.dtype).reshape(saved.shape).contiguous()


def softmax_backward(grad_output, output, stats, dim):
    y, g, stats, d, _ = _backward_rows("softmax_backward", grad_output, output, stats, dim, None,
                                       False)
    bound = nf_largest(output.dtype)
    dx = softmax_grad_value(g, y, (g * y).sum(dim=d, keepdim=True), bound)
    return _finish(dx, stats, d, None, output)


def log_softmax_backward(grad_output, output, stats, dim, mask=None):
    y, g, stats, d, mask = _backward_rows("log_softmax_backward", grad_output, output, stats, dim,
                                          mask, False)
    kept = g if mask is None else g.masked_fill(~mask, 0.0)
    plain = kept.sum(dim=d, keepdim=True)
    scaled = (kept * grad_sum_scale()).sum(dim=d, keepdim=True)
    dx = log_softmax_grad_value(g, y, plain, scaled, nf_largest(output.dtype))
    return _finish(dx, stats, d, mask, output)


def logsumexp_backward(grad_output, input, stats, dim, mask=None):
    x, g, stats, d, mask = _backward_rows("logsumexp_backward", grad_output, input, stats, dim,
                                          mask, True)
    # Dropped entries (NaN included) get 0 (in _finish).
    return _finish(logsumexp_grad_value(g, x, stats, d), stats, d, mask, input)
