"""The softmax family over the last dimension, in plain torch operations.

Mirrors csrc/include/nanfree/softmax_math.h: the same online (max, sum) state
taken whole-row, and the same special-value rules, written with torch.where.
Signatures and results are those of the ``nanfree::*_lastdim`` ops.
"""

import torch

from .._softmax_checks import acc_dtype, check_backward, check_float, check_mask

INF = float("inf")


def _masked(input: torch.Tensor, mask) -> torch.Tensor:
    x = input.to(acc_dtype(input.dtype))
    # masked_value: a dropped entry is exactly -inf, whatever it held.
    return x if mask is None else x.masked_fill(~mask, -INF)


def lse_state(x: torch.Tensor):
    """(max, sum, exps) of each row of x: max never NaN, exps = lse_scale(x, max)."""
    if x.shape[-1] == 0:
        shape = x.shape[:-1]
        return x.new_full(shape, -INF), x.new_zeros(shape), x
    # NaN must not become the max (it reaches sum through its exp instead).
    row_max = torch.where(torch.isnan(x), -INF, x).amax(dim=-1, keepdim=True)
    # lse_scale: exactly 1 where x == max (also +inf == +inf, where x - max is
    # NaN); lse_update: a -inf entry adds 0 even when the max is -inf too.
    exps = torch.where(x == -INF, 0.0, torch.where(x == row_max, 1.0, torch.exp(x - row_max)))
    return row_max.squeeze(-1), exps.sum(dim=-1), exps


def _forward_state(input, mask, op):
    check_float(op, "input", input)
    check_mask(op, input, mask)
    if input.dim() == 0:  # one row of one entry, as the compiled kernels
        input = input.reshape(1)
        mask = None if mask is None else mask.reshape(1)
    x = _masked(input, mask)
    row_max, row_sum, exps = lse_state(x)
    log_sum = torch.log(row_sum)
    # row_stats: (max, log_sum) per row, saved for the backward.
    stats = torch.stack([row_max, log_sum], dim=-1)
    return x, row_max, row_sum, exps, stats


def softmax_lastdim(input, mask=None):
    _, row_max, row_sum, exps, stats = _forward_state(input, mask, "softmax")
    # softmax_value: an empty row is all 0 rather than 0/0 (a NaN sum stays NaN).
    empty = (row_max == -INF) & ~torch.isnan(row_sum)
    out = torch.where(empty.unsqueeze(-1), 0.0, exps / row_sum.unsqueeze(-1))
    return out.to(input.dtype).contiguous().reshape(input.shape), stats


def log_softmax_lastdim(input, mask=None):
    x, row_max, _, _, stats = _forward_state(input, mask, "log_softmax")
    log_sum = stats[..., 1:]
    m = row_max.unsqueeze(-1)
    # log_softmax_value: -inf for an empty row (a NaN sum stays NaN); -log k on
    # the +inf entries.
    empty = (m == -INF) & ~torch.isnan(log_sum)
    out = torch.where(empty, -INF, torch.where(x == m, -log_sum, (x - m) - log_sum))
    return out.to(input.dtype).contiguous().reshape(input.shape), stats


def logsumexp_lastdim(input, mask=None):
    *_, stats = _forward_state(input, mask, "logsumexp")
    # lse_value: max + log(sum) is -inf for an empty row, +inf with a +inf entry.
    return (stats[..., 0] + stats[..., 1]).to(input.dtype), stats


def _row_has_gradient(stats):
    # An empty row (max -inf) and a row holding +inf (max +inf) pass no
    # gradient; a row holding NaN passes its NaN on.
    return ~torch.isinf(stats[..., :1]) | torch.isnan(stats[..., 1:])


def softmax_lastdim_backward(grad_output, output, stats):
    check_backward("softmax_backward", grad_output, output, stats, None, output.shape)
    acc = stats.dtype
    g, y = grad_output.to(acc), output.to(acc)
    dx = y * (g - (g * y).sum(dim=-1, keepdim=True))
    return torch.where(_row_has_gradient(stats), dx, 0.0).to(output.dtype).contiguous()


def log_softmax_lastdim_backward(grad_output, output, stats, mask=None):
    check_backward("log_softmax_backward", grad_output, output, stats, mask, output.shape)
    acc = stats.dtype
    g, y = grad_output.to(acc), output.to(acc)
    kept = g if mask is None else g.masked_fill(~mask, 0.0)
    dx = g - torch.exp(y) * kept.sum(dim=-1, keepdim=True)
    if mask is not None:
        dx = dx.masked_fill(~mask, 0.0)  # a dropped entry's output is constant
    return torch.where(_row_has_gradient(stats), dx, 0.0).to(output.dtype).contiguous()


def logsumexp_lastdim_backward(grad_output, input, stats, mask=None):
    check_backward("logsumexp_backward", grad_output, input, stats, mask, input.shape[:-1])
    acc = stats.dtype
    x = input.to(acc)
    softmax = torch.exp((x - stats[..., :1]) - stats[..., 1:])
    dx = grad_output.to(acc).unsqueeze(-1) * softmax
    if mask is not None:
        dx = dx.masked_fill(~mask, 0.0)  # dropped entries (NaN included) get 0
    return torch.where(_row_has_gradient(stats), dx, 0.0).to(input.dtype).contiguous()
