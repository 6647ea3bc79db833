"""The softmax family over one dimension, in plain torch operations.

Mirrors csrc/include/nanfree/softmax_math.h: the same online (max, sum) state
taken over the whole reduced dimension, and the same special-value rules,
written with torch.where. Signatures and results are those of the
``nanfree::softmax`` ops (csrc/registration.cpp).
"""

import torch

from .._softmax_checks import check_backward, check_forward

INF = float("inf")


def _as_rows(t, dim):
    """A 0-d tensor as one row of one entry (dim 0), as the compiled kernels treat it."""
    return (t.reshape(1), 0) if t.dim() == 0 else (t, dim)


def _masked(input, mask):
    x = input.to(torch.float64 if input.dtype == torch.float64 else torch.float32)
    # masked_value: a dropped entry is exactly -inf, whatever it held.
    return x if mask is None else x.masked_fill(~mask, -INF)


def lse_state(x, dim):
    """(max, sum, exps) along dim (kept as size 1): max never NaN, exps = lse_scale(x, max)."""
    if x.shape[dim] == 0:
        shape = list(x.shape)
        shape[dim] = 1
        return x.new_full(shape, -INF), x.new_zeros(shape), x
    # NaN must not become the max (it reaches sum through its exp instead).
    row_max = torch.where(torch.isnan(x), -INF, x).amax(dim=dim, keepdim=True)
    # lse_scale: exactly 1 where x == max (also +inf == +inf, where x - max is
    # NaN); lse_update: a -inf entry adds 0 even when the max is -inf too.
    exps = torch.where(x == -INF, 0.0, torch.where(x == row_max, 1.0, torch.exp(x - row_max)))
    return row_max, exps.sum(dim=dim, keepdim=True), exps


def _forward_state(op, input, dim, mask):
    dim, mask = check_forward(op, input, dim, mask)
    x, dim = _as_rows(input, dim)
    mask = None if mask is None else mask.reshape(x.shape)
    x = _masked(x, mask)
    row_max, row_sum, exps = lse_state(x, dim)
    log_sum = torch.log(row_sum)
    # row_stats: (max, log_sum) along dim, saved for the backward.
    stats = torch.cat([row_max, log_sum], dim=dim)
    return x, dim, row_max, row_sum, exps, stats


def softmax(input, dim, mask=None):
    _, _, row_max, row_sum, exps, stats = _forward_state("softmax", input, dim, mask)
    # softmax_value: an empty row is all 0 rather than 0/0 (a NaN sum stays NaN).
    empty = (row_max == -INF) & ~torch.isnan(row_sum)
    out = torch.where(empty, 0.0, exps / row_sum)
    return out.to(input.dtype).reshape(input.shape).contiguous(), stats


def log_softmax(input, dim, mask=None):
    x, _, row_max, row_sum, _, stats = _forward_state("log_softmax", input, dim, mask)
    log_sum = torch.log(row_sum)
    # log_softmax_value: -inf for an empty row (a NaN sum stays NaN); -log k on
    # the +inf entries.
    empty = (row_max == -INF) & ~torch.isnan(log_sum)
    out = torch.where(empty, -INF, torch.where(x == row_max, -log_sum, (x - row_max) - log_sum))
    return out.to(input.dtype).reshape(input.shape).contiguous(), stats


def logsumexp(input, dim, mask=None):
    _, d, row_max, row_sum, _, stats = _forward_state("logsumexp", input, dim, mask)
    # lse_value: max + log(sum) is -inf for an empty row, +inf with a +inf entry.
    out = (row_max + torch.log(row_sum)).squeeze(d).to(input.dtype)
    return out.reshape(()) if input.dim() == 0 else out, stats


def _row_has_gradient(stats, dim):
    # An empty row (max -inf) and a row holding +inf (max +inf) pass no
    # gradient; a row holding NaN passes its NaN on.
    row_max, log_sum = stats.narrow(dim, 0, 1), stats.narrow(dim, 1, 1)
    return ~torch.isinf(row_max) | torch.isnan(log_sum)


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
    dx = torch.where(_row_has_gradient(stats, dim), dx, 0.0)
    return dx.to(saved.dtype).reshape(saved.shape).contiguous()


def softmax_backward(grad_output, output, stats, dim):
    y, g, stats, d, _ = _backward_rows("softmax_backward", grad_output, output, stats, dim, None,
                                       False)
    dx = y * (g - (g * y).sum(dim=d, keepdim=True))
    return _finish(dx, stats, d, None, output)


def log_softmax_backward(grad_output, output, stats, dim, mask=None):
    y, g, stats, d, mask = _backward_rows("log_softmax_backward", grad_output, output, stats, dim,
                                          mask, False)
    kept = g if mask is None else g.masked_fill(~mask, 0.0)
    dx = g - torch.exp(y) * kept.sum(dim=d, keepdim=True)
    return _finish(dx, stats, d, mask, output)


def logsumexp_backward(grad_output, input, stats, dim, mask=None):
    x, g, stats, d, mask = _backward_rows("logsumexp_backward", grad_output, input, stats, dim,
                                          mask, True)
    row_max, log_sum = stats.narrow(d, 0, 1), stats.narrow(d, 1, 1)
    dx = g * torch.exp((x - row_max) - log_sum)
    # Dropped entries (NaN included) get 0.
    return _finish(dx, stats, d, mask, input)
