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

Stats layout (what ``gem`` saves for ``gem_backward``): a tensor of the
accumulation dtype and shape ``[3, *kept]``, where ``kept`` is the input's
shape without the reduced dims (as the output with keepdim=False):

- ``stats[0]``: m, the largest clamped kept entry (0 for an empty reduction,
  +inf with a +inf entry, NaN with a NaN entry);
- ``stats[1]``: mean, the mean of r^p over the kept entries (0 when empty,
  else in [1/n, 1] or NaN);
- ``stats[2]``: count, the number n of kept entries (exact up to 2^24 in float32).

Not registered with torch.library yet: plain functions.
"""

import math

import torch

INF = float("inf")
GEM_MIN_P = 1e-2
GEM_MAX_P = 1e2


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def gem_tiny(dtype):
    return torch.finfo(dtype).tiny


def gem_big(dtype):
    return torch.finfo(dtype).max


def gem_clamp_p(p):
    """A tensor p clamped to [1e-2, 1e2]; NaN stays NaN."""
    return torch.where(p < GEM_MIN_P, GEM_MIN_P, torch.where(p > GEM_MAX_P, GEM_MAX_P, p))


def gem_p_in_range(p):
    """torch.clamp's gradient mask: p strictly inside (1e-2, 1e2)."""
    return (p > GEM_MIN_P) & (p < GEM_MAX_P)


def gem_effective_eps(eps, dtype):
    # An eps below the accumulation type's smallest normal is raised to it:
    # log(eps) and m / eps stay finite.
    return max(eps, gem_tiny(dtype))


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
    return torch.where(r < gem_tiny(c.dtype), torch.log(c) - torch.log(m), torch.log(r))


def gem_ratio_power(c, m, p):
    """r^p in [0, 1]: pow for a normal ratio, the log domain below it; NaN
    stays NaN; for m = +inf the limit ratio's power (1 or 0)."""
    r = c / m
    direct = torch.pow(r, p)
    logd = torch.exp(p * (torch.log(c) - torch.log(m)))
    out = torch.where(r < gem_tiny(c.dtype), logd, direct)  # r NaN -> direct (NaN)
    return torch.where(m == INF, gem_ratio(c, m), out)


def gem_mean(total, count):
    # 0 for the empty set (0 / 0 would be NaN); else in [1/n, 1] or NaN.
    return torch.where(count == 0, 0.0, total / torch.where(count == 0, 1.0, count))


def gem_value(m, mean, p):
    """m * mean^(1/p); 0 for the empty set; the log domain when mean^(1/p)
    underflows; +inf for m = +inf; NaN stays."""
    s = torch.pow(mean, 1.0 / p)
    logd = torch.exp(torch.log(m) + torch.log(mean) / p)
    out = torch.where(s < gem_tiny(m.dtype), logd, m * s)
    return torch.where(mean == 0, 0.0, out)


def gem_has_gradient(m, count):
    # Not empty and no +inf entry; a NaN m passes (NaN reaches the gradients).
    return (count > 0) & (m != INF)


def gem_input_grad_weight(c, m, mean, count, p):
    """dgem/dx = mean^(1/p-1) * r^(p-1) / n for an unclamped kept entry; in the
    log domain where the direct product could be inf * 0 (p < 1, tiny r) or
    the ratio is below the normal range;
    bounded by the type's largest value."""
    big = gem_big(c.dtype)
    a = torch.pow(mean, 1.0 / p - 1.0) / count
    r = c / m
    rp1 = torch.pow(r, p - 1.0)
    # A ratio below the normal range lost bits (or is 0: 0^(p-1) = inf for p < 1).
    direct_ok = (a >= gem_tiny(c.dtype)) & (r >= gem_tiny(c.dtype)) & (rp1 <= big)
    logd = torch.exp((1.0 / p - 1.0) * torch.log(mean) - torch.log(count)
                     + (p - 1.0) * gem_log_ratio(c, m))
    w = torch.where(direct_ok, a * rp1, logd)  # NaN fails direct_ok and stays NaN
    return torch.where(w > big, big, w)  # a 0 incoming gradient must not meet inf


def gem_input_grad(g, x, eps, m, mean, count, p):
    """g * weight for an unclamped kept entry of a reduction with gradient, else 0
    (masked entries are zeroed by the caller)."""
    live = gem_has_gradient(m, count) & gem_unclamped(x, eps)
    w = gem_input_grad_weight(clamp_to_eps(x, eps), m, mean, count, p)
    return torch.where(live, g * w, 0.0)


def gem_divergence_h(s):
    """h(s) = 1 + (s - 1) e^s = t log t - t + 1 at t = e^s (>= 0): the series
    s^2 * sum_k s^k / (k! (k + 2)) for |s| <= 1 (no cancellation beyond about
    a bit), the closed form beyond (at most 1.73 / 0.26 lost, at s = -1)."""
    terms = 17 if s.dtype == torch.float64 else 10
    term = torch.ones_like(s)
    total = torch.full_like(s, 0.5)
    for k in range(1, terms + 1):
        term = term * (s / k)
        total = total + term / (k + 2)
    series = s * s * total
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
    big = gem_big(m.dtype)
    v = (gem * (divergence / (p * p))).clamp(-big, big)  # NaN stays
    return torch.where(gem_has_gradient(m, count), g * v, 0.0)


def gem_saturate(x, dtype):
    # Into dtype's finite range (fp16 gradients for p < 1); NaN stays.
    big = gem_big(dtype)
    return x.clamp(-big, big)


# -- layout -----------------------------------------------------------------


def _dims(dim, ndim):
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    n = max(ndim, 1)
    out = []
    for d in dims:
        if not -n <= d < n:
            raise IndexError(f"nanfree.gem: `dim` {d} is out of range for a {ndim}-d input")
        out.append(d % n)
    if len(set(out)) != len(out):
        raise ValueError(f"nanfree.gem: `dim` {dim} repeats a dimension")
    return tuple(sorted(out))


def _to_rows(t, dims):
    """t viewed as [*kept, N] with the reduced dims flattened last."""
    if t.dim() == 0:
        return t.reshape(1)
    kept = [d for d in range(t.dim()) if d not in dims]
    t = t.permute(*kept, *dims)
    return t.reshape(*t.shape[:len(kept)], -1)


def _from_rows(rows, shape, dims):
    """The inverse of _to_rows for a tensor of `shape`."""
    if len(shape) == 0:
        return rows.reshape(())
    kept = [d for d in range(len(shape)) if d not in dims]
    perm = kept + list(dims)
    t = rows.reshape([shape[d] for d in perm])
    return t.permute(*[perm.index(d) for d in range(len(shape))])


def _keep_mask(mask, input, dims):
    if mask is None:
        return None
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError("nanfree.gem: `mask` must be bool or integer, got " + str(mask.dtype))
    keep = mask if mask.dtype == torch.bool else mask != 0
    return _to_rows(keep.expand(input.shape), dims)


def _p_value(p, acc):
    """(p as an acc tensor broadcastable over rows, whether p is a tensor)."""
    if isinstance(p, torch.Tensor):
        if p.numel() != 1 or p.dim() > 1:
            raise ValueError(f"nanfree.gem: a tensor `p` must have shape [] or [1], got {list(p.shape)}")
        # Clamped in float32 (p is used in float32 whatever the input dtype;
        # the bounds are float32's 1e-2 and 1e2), then widened for float64 inputs.
        return gem_clamp_p(p.detach().float().reshape(())).to(acc), True
    p = float(p)
    if not (math.isfinite(p) and p > 0):
        raise ValueError(f"nanfree.gem: `p` must be finite and > 0, got {p}")
    return torch.tensor(p, dtype=acc), False


def _reduce_state(x, eps, keep, p):
    """(c, m, mean, count) over the last dim of x ([*kept, N], acc dtype)."""
    c = clamp_to_eps(x, eps)
    if keep is not None:
        c = torch.where(keep, c, 0.0)  # below every clamped entry: out of the max
    if x.shape[-1] == 0:
        shape = x.shape[:-1] + (1,)
        zeros = x.new_zeros(shape)
        return c, zeros, zeros, zeros
    m = gem_max_update(c, -1)
    rp = gem_ratio_power(c, m, p)
    if keep is not None:
        rp = torch.where(keep, rp, 0.0)
        count = keep.sum(dim=-1, keepdim=True).to(x.dtype)
    else:
        count = torch.full_like(m, x.shape[-1])
    mean = gem_mean(rp.sum(dim=-1, keepdim=True), count)
    return c, m, mean, count


def gem(input, p=3.0, dim=-1, eps=1e-6, keepdim=False, mask=None):
    """(output, stats): mean(max(x, eps)^p)^(1/p) over `dim` (int or tuple) of
    the kept entries. See the module docstring for the stats layout."""
    if input.dtype.is_floating_point is False:
        raise TypeError(f"nanfree.gem: `input` must be a floating tensor, got {input.dtype}")
    if not (isinstance(eps, (int, float)) and eps > 0 and math.isfinite(eps)):
        raise ValueError(f"nanfree.gem: `eps` must be finite and > 0, got {eps}")
    acc = _acc_dtype(input.dtype)
    dims = _dims(dim, input.dim())
    pv, _ = _p_value(p, acc)
    pv = pv.to(input.device)
    eps_a = gem_effective_eps(float(eps), acc)
    x = _to_rows(input.to(acc), dims)
    keep = _keep_mask(mask, input, dims)
    _, m, mean, count = _reduce_state(x, eps_a, keep, pv)
    out = gem_value(m, mean, pv).squeeze(-1)
    stats = torch.stack([m.squeeze(-1), mean.squeeze(-1), count.squeeze(-1)])
    if keepdim:
        shape = [1 if d in dims else s for d, s in enumerate(input.shape)]
        out = out.reshape(shape)
    return out.to(input.dtype).contiguous(), stats


def gem_backward(grad_output, input, p, output, stats, dim=-1, eps=1e-6, keepdim=False,
                 mask=None):
    """(grad_input, grad_p) of ``gem``: grad_input has input's shape and dtype;
    grad_p has p's shape and dtype when p is a tensor (0 where p is outside
    the clamp), else None."""
    acc = _acc_dtype(input.dtype)
    dims = _dims(dim, input.dim())
    pv, p_is_tensor = _p_value(p, acc)
    pv = pv.to(input.device)
    eps_a = gem_effective_eps(float(eps), acc)
    m, mean, count = (s.unsqueeze(-1) for s in stats.to(acc))
    x = _to_rows(input.to(acc), dims)
    keep = _keep_mask(mask, input, dims)
    kept_shape = stats.shape[1:]
    g = grad_output.to(acc).reshape(kept_shape).unsqueeze(-1)
    # gem in the accumulation type from the stats, not the output rounded to
    # fp16/bf16 (whose rounding would enter p's gradient).
    gem_out = gem_value(m, mean, pv)
    dx = gem_input_grad(g, x, eps_a, m, mean, count, pv)
    if keep is not None:
        dx = torch.where(keep, dx, 0.0)  # a masked entry gets 0, even NaN or inf
    grad_input = _from_rows(gem_saturate(dx, input.dtype), input.shape, dims)
    grad_input = grad_input.to(input.dtype).contiguous()
    if not p_is_tensor:
        return grad_input, None
    c = clamp_to_eps(x, eps_a)
    if x.shape[-1] == 0:
        divergence = torch.zeros_like(m)
    else:
        live = gem_has_gradient(m, count)
        # Reductions without gradient (empty: m = 0, mean = 0; +inf: m = +inf)
        # get m = 1 and log(mean) = 0 here, so their unused terms stay finite.
        log_mean = torch.log(torch.where(live, mean, 1.0))
        term = gem_divergence_term(c, torch.where(live, m, 1.0), log_mean, pv)
        if keep is not None:
            term = torch.where(keep, term, 0.0)
        divergence = gem_mean(term.sum(dim=-1, keepdim=True), count)
    dp = gem_p_grad(g, gem_out, m, count, divergence, pv).sum()
    p_raw = p.detach().float().reshape(())
    dp = torch.where(gem_p_in_range(p_raw), dp, 0.0)
    dp = gem_saturate(dp, p.dtype)
    return grad_input, dp.to(p.dtype).reshape(p.shape)
