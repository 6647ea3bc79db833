"""Generalized mean (GeM) pooling over one dim or a tuple of dims, in plain
torch operations.

Mirrors csrc/include/nanfree/gem_math.h function by function (same names):
each reduction is scaled by its largest clamped value m, so every ratio
r = max(x, eps) / m is in (0, 1], the mean of r^p is in [1/n, 1] and
gem = m * mean^(1/p); the special-value rules are the same, written with
torch.where (both branches of a where are evaluated; these functions are
never differentiated by autograd, so an unused inf or NaN branch is harmless).

fp16/bf16 inputs are computed in float32, float64 in float64; a tensor p is
clamped to [1e-2, 1e2] and used in that accumulation type.

The ops ``gem`` and ``gem_backward`` (schemas in csrc/registration.cpp) reduce
dim 1 of a 3-D input [outer, n, inner]. Stats layout (what ``gem`` saves for
``gem_backward``): a tensor of the accumulation dtype and shape
``[outer, inner, 3]``:

- ``[..., 0]``: m, the largest clamped kept entry (0 for an empty reduction,
  +inf with a +inf entry, NaN with a NaN entry);
- ``[..., 1]``: mean, the mean of r^p over the kept entries (0 when empty,
  else in [1/n, 1] or NaN);
- ``[..., 2]``: count, the number n of kept entries (exact up to 2^24 in float32).
"""


import torch

from .._ops.gem import (check_gem, check_gem_backward, gem_divergence_coefficient,
                        gem_p_grad_total)
from .numerics import INF, acc_dtype, effective_eps, nf_largest, nf_tiny, saturate


GEM_MIN_P = 1e-2
GEM_MAX_P = 1e2


def gem_clamp_p(p):
    """A tensor p clamped to [1e-2, 1e2]; NaN stays NaN."""
    return torch.where(p < GEM_MIN_P, GEM_MIN_P, torch.where(p > GEM_MAX_P, GEM_MAX_P, p))


def gem_p_in_range(p):
    """Whether p passes its gradient: inside [1e-2, 1e2] or at a bound."""
    return (p >= GEM_MIN_P) & (p <= GEM_MAX_P)


def clamp_to_eps(x, eps):
    # max(x, eps); NaN stays NaN (x < eps is false for it).
    return torch.where(x < eps, eps, x)


def gem_unclamped(x, eps):
    # x > eps (torch.clamp's gradient is 0 at the bound), and NaN too: a NaN
    # entry's gradient is NaN like its row's.
    return ~(x <= eps)


def gem_max_update(c, dim):
    """The maximum of the clamped entries along dim (kept): NaN if one is NaN
    (amax propagates NaN, like the header's sticky update). Masked entries
    must be 0 in c (below every clamped entry, so 0 is also the empty set's m)."""
    return c.amax(dim=dim, keepdim=True)


def gem_ratio(c, m):
    # c / m; for m = +inf the limit: 1 at a +inf entry (inf / inf is NaN), 0 elsewhere.
    return torch.where(m == INF, (c == INF).to(c.dtype), c / m)


def gem_log_ratio(c, m):
    # log r; a ratio below the normal range lost bits or underflowed to 0
    # (log 0 = -inf): there log c - log m, finite since c >= eps >= tiny.
    r = c / m
    return torch.where(r < nf_tiny(c.dtype), torch.log(c) - torch.log(m), torch.log(r))


def gem_ratio_power(c, m, p):
    """r^p in [0, 1]: pow for a normal ratio, the log domain below it; NaN
    stays NaN; for m = +inf the limit ratio's power (1 or 0)."""
    r = c / m
    direct = torch.pow(r, p)
    logd = torch.exp(p * (torch.log(c) - torch.log(m)))
    out = torch.where(r < nf_tiny(c.dtype), logd, direct)  # r NaN -> direct (NaN)
    return torch.where(m == INF, gem_ratio(c, m), out)


def gem_mean(total, count):
    # 0 for the empty set (0 / 0 would be NaN); else in [1/n, 1] or NaN.
    return torch.where(count == 0, 0.0, total / torch.where(count == 0, 1.0, count))


def gem_value(m, mean, p):
    """m * mean^(1/p); 0 for the empty set; the log domain when mean^(1/p)
    underflows; +inf for m = +inf; NaN stays."""
    s = torch.pow(mean, 1.0 / p)
    logd = torch.exp(torch.log(m) + torch.log(mean) / p)
    out = torch.where(s < nf_tiny(m.dtype), logd, m * s)
    return torch.where(mean == 0, 0.0, out)


def gem_has_gradient(m, count):
    # Not empty and no +inf entry; a NaN m passes (NaN reaches the gradients).
    return (count > 0) & (m != INF)


def gem_input_grad_weight(c, m, mean, count, p):
    """dgem/dx = mean^(1/p-1) * r^(p-1) / n for an unclamped kept entry; in the
    log domain where the direct product could be inf * 0 (p < 1, tiny r) or
    the ratio is below the normal range;
    bounded by the type's largest value."""
    big = nf_largest(c.dtype)
    a = torch.pow(mean, 1.0 / p - 1.0) / count
    r = c / m
    rp1 = torch.pow(r, p - 1.0)
    # A ratio below the normal range lost bits (or is 0: 0^(p-1) = inf for p < 1).
    direct_ok = (a >= nf_tiny(c.dtype)) & (r >= nf_tiny(c.dtype)) & (rp1 <= big)
    logd = torch.exp((1.0 / p - 1.0) * torch.log(mean) - torch.log(count)
                     + (p - 1.0) * gem_log_ratio(c, m))
    w = torch.where(direct_ok, a * rp1, logd)  # NaN fails direct_ok and stays NaN
    return saturate(w, big)  # a 0 incoming gradient must not meet inf; NaN stays


def gem_input_grad(g, x, eps, m, mean, count, p):
    """g * weight for an unclamped kept entry of a reduction with gradient, else 0
    (masked entries are zeroed by the caller)."""
    live = gem_has_gradient(m, count) & gem_unclamped(x, eps)
    w = gem_input_grad_weight(clamp_to_eps(x, eps), m, mean, count, p)
    return torch.where(live, g * w, 0.0)


def gem_divergence_h(s):
    """h(s) = 1 + (s - 1) e^s = t log t - t + 1 at t = e^s (>= 0): the series
    s^2 * sum_k c_k s^k by Horner's rule for |s| <= 1 (no cancellation beyond
    about a bit), the closed form beyond (at most 1.73 / 0.26 lost, at s = -1)."""
    last = 17 if s.dtype == torch.float64 else 10
    poly = torch.full_like(s, gem_divergence_coefficient(last))
    for k in range(last - 1, -1, -1):
        poly = gem_divergence_coefficient(k) + s * poly
    series = s * s * poly
    # s <= log n, so e^s is finite; a very negative s underflows it to 0: h = 1,
    # the limit. A NaN s fails the test and takes the closed form (NaN).
    closed = 1.0 + (s - 1.0) * torch.exp(s)
    return torch.where((s >= -1.0) & (s <= 1.0), series, closed)


def gem_divergence_term(c, m, log_mean, p):
    """h(s), s = p log r - log(mean): one kept entry's term of D (clamped ones
    included, masked ones zeroed by the caller). For a reduction with gradient
    (m finite, n > 0), where s is finite; an r^p below the type's range gives
    1, the limit. NaN stays."""
    return gem_divergence_h(p * gem_log_ratio(c, m) - log_mean)


def gem_p_grad(g, gem, m, count, divergence, p):
    """g * gem * D / p^2 of a reduction with gradient, else 0 (D in [0, log n]);
    gem * D / p^2 is bounded by the type's range before meeting g."""
    big = nf_largest(m.dtype)
    v = saturate(gem * (divergence / (p * p)), big)  # NaN stays
    # g * v saturated too: the sum over reductions must never meet inf - inf.
    return torch.where(gem_has_gradient(m, count), saturate(g * v, big), 0.0)


# -- the ops -----------------------------------------------------------------


def gem_p_acc(p, p_value, acc, device):
    """p as a 0-d tensor of the accumulation dtype: a tensor p clamped
    (gem_clamp_p), a Python p as is."""
    if p is None:
        return torch.tensor(p_value, dtype=acc, device=device)
    return gem_clamp_p(p.detach().reshape(()).to(acc))


def _reduce_state(x, eps, keep, p):
    """(c, m, mean, count) over dim 1 of x ([outer, n, inner], acc dtype), kept dims."""
    c = clamp_to_eps(x, eps)
    if keep is not None:
        c = torch.where(keep, c, 0.0)  # below every clamped entry: out of the max
    if x.shape[1] == 0:
        zeros = x.new_zeros((x.shape[0], 1, x.shape[2]))
        return c, zeros, zeros, zeros
    m = gem_max_update(c, 1)
    rp = gem_ratio_power(c, m, p)
    if keep is not None:
        rp = torch.where(keep, rp, 0.0)
        count = keep.sum(dim=1, keepdim=True).to(x.dtype)
    else:
        count = torch.full_like(m, x.shape[1])
    mean = gem_mean(rp.sum(dim=1, keepdim=True), count)
    return c, m, mean, count


def gem(input, p, p_value, eps, mask=None):
    """(output [outer, inner], stats [outer, inner, 3]) of the op nanfree::gem."""
    check_gem(input, p, p_value, eps, mask)
    acc = acc_dtype(input.dtype)
    pv = gem_p_acc(p, p_value, acc, input.device)
    eps_a = effective_eps(float(eps), acc)
    x = input.to(acc)
    _, m, mean, count = _reduce_state(x, eps_a, mask, pv)
    out = gem_value(m, mean, pv).squeeze(1)
    stats = torch.stack([m.squeeze(1), mean.squeeze(1), count.squeeze(1)], dim=-1)
    return out.to(input.dtype), stats


def gem_backward(grad_output, input, p, p_value, stats, eps, mask, p_grad):
    """(grad_input, grad_p) of the op nanfree::gem_backward: grad_p is the 0-d
    sum over reductions of d gem / d p (acc dtype) when p_grad, else empty [0]."""
    check_gem_backward(grad_output, input, p, p_value, stats, eps, mask, p_grad)
    acc = acc_dtype(input.dtype)
    pv = gem_p_acc(p, p_value, acc, input.device)
    eps_a = effective_eps(float(eps), acc)
    m, mean, count = (s.unsqueeze(1) for s in stats.unbind(-1))
    x = input.to(acc)
    g = grad_output.to(acc).unsqueeze(1)
    dx = gem_input_grad(g, x, eps_a, m, mean, count, pv)
    if mask is not None:
        dx = torch.where(mask, dx, 0.0)  # a masked entry gets 0, even NaN or inf
    # Into the input dtype's finite range (fp16 gradients for p < 1); NaN stays.
    grad_input = saturate(dx, nf_largest(input.dtype)).to(input.dtype)
    if not p_grad:
        return grad_input, input.new_empty((0,), dtype=acc)
    # gem in the accumulation type from the stats, not the output rounded to
    # fp16/bf16 (whose rounding would enter p's gradient).
    gem_out = gem_value(m, mean, pv)
    if x.shape[1] == 0:
        divergence = torch.zeros_like(m)
    else:
        live = gem_has_gradient(m, count)
        # Reductions without gradient (empty: m = 0, mean = 0; +inf: m = +inf)
        # get m = 1 and log(mean) = 0 here, so their unused terms stay finite.
        log_mean = torch.log(torch.where(live, mean, 1.0))
        term = gem_divergence_term(clamp_to_eps(x, eps_a), torch.where(live, m, 1.0), log_mean, pv)
        if mask is not None:
            term = torch.where(mask, term, 0.0)
        divergence = gem_mean(term.sum(dim=1, keepdim=True), count)
    dp = gem_p_grad_total(gem_p_grad(g, gem_out, m, count, divergence, pv), acc)
    return grad_input, dp
