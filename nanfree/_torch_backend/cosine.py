"""The cosine family (normalize, cosine_similarity, cos_sim_matrix) over the
last dimension, in plain torch operations.

Mirrors csrc/include/nanfree/cosine_math.h function by function (same names):
each vector is scaled by an exact power of two before its squares are
summed, so no norm overflows or underflows; the special-value rules are the
same, written with torch.where. Signatures and results are those of the
``nanfree::normalize`` ops (csrc/registration.cpp).
"""

import math

import torch

from .._ops.cosine import (check_cos_sim_matrix, check_cosine, check_cosine_backward,
                           check_normalize, check_normalize_backward)
from .numerics import (INF, acc_dtype, effective_eps, grad_sum_overflowed, grad_sum_scale,
                       grad_sum_unscale, nf_largest, saturate)

def _acc(t):
    return t.to(acc_dtype(t.dtype))


def norm_scale(amax):
    """p = 2^-e with e = ilogb(amax) clamped to the normal exponents; NaN for a
    NaN amax (it reaches every scaled entry), 0 for +inf (the infinite-vector mark)."""
    info = torch.finfo(amax.dtype)
    # The normal exponents: 2^e for e in [min_e, max_e] ([-126, 127] in float32).
    min_e, max_e = math.frexp(info.tiny)[1] - 1, math.frexp(info.max)[1] - 1
    # frexp gives amax = m * 2^f with m in [0.5, 1): ilogb(amax) = f - 1 (0 has no exponent).
    e = torch.where(amax > 0, torch.frexp(amax).exponent.to(torch.int64) - 1, 0)
    e = e.clamp(min_e, max_e)
    # Exact powers of two, built in float64 (2^-e may be subnormal in amax's dtype).
    p = torch.ldexp(torch.ones_like(amax, dtype=torch.float64), -e).to(amax.dtype)
    p = torch.where(amax == INF, 0.0, p)  # the infinite-vector mark
    return torch.where(torch.isnan(amax), amax, p)  # NaN reaches every scaled entry


def scaled_entry(x, p):
    """x * p, or for an infinite vector (p == 0) the limit: +-1 at +-inf, 0 elsewhere."""
    limit = torch.where(torch.isinf(x), torch.sign(x), 0.0)
    return torch.where(p == 0, limit, x * p)


def norm_factors(p, ssq, eps):
    """(q, divisor, grad_factor) from one square root: q with x / max(norm, eps)
    == scaled_entry(x, p) * q; divisor sqrt(ssq) where q is 1 / sqrt(ssq), else
    0; grad_factor 1 / sqrt(ssq), or 0 for vectors below eps, zero and infinite
    ones. NaN throughout for a NaN vector."""
    root = torch.sqrt(ssq)
    unit = 1.0 / root
    # root >= eps * p; an overflowing eps * p means the vector is tiny: False.
    at_least = root >= eps * p
    divides = at_least | (p == 0)  # an infinite vector's limit direction divides too
    q = torch.where(divides, unit, (1.0 / eps) / p)
    divisor = torch.where(divides, root, 0.0)
    grad_factor = torch.where(at_least & (p != 0), unit, 0.0)
    zero, nan = ssq == 0, torch.isnan(ssq)
    # A zero vector: q, divisor and gradient 0; NaN stays NaN.
    return tuple(torch.where(nan, ssq, torch.where(zero, 0.0, v)) for v in (q, divisor, grad_factor))


def unit_divisor(divisor, p, amax):
    """The divisor (norm_factors) where it equals the largest scaled magnitude (an entry
    normalized_entry makes exactly +-1), else 0 (NaN vectors: 0, their q is NaN)."""
    return torch.where((divisor > 0) & (divisor == scaled_entry(amax, p)), divisor, 0.0)


def normalized_entry(s, divisor, q):
    """s * q, and exactly +-1 where |s| is the (positive) divisor, as the quotient is."""
    unit = torch.where(s > 0, 1.0, -1.0)
    return torch.where((divisor > 0) & (s.abs() == divisor), unit, s * q)


def cosine_clamp(c):
    # Into [-1, 1]; NaN stays NaN.
    return torch.where(c > 1, 1.0, torch.where(c < -1, -1.0, c))


def cosine_value(scaled_dot, divisor1, divisor2, q1, q2):
    """scaled_dot / (divisor1 * divisor2) where both are positive, else (scaled_dot * q1) * q2; clamped."""
    divisible = (divisor1 > 0) & (divisor2 > 0)
    quotient = scaled_dot / torch.where(divisible, divisor1 * divisor2, 1.0)
    return cosine_clamp(torch.where(divisible, quotient, (scaled_dot * q1) * q2))


def normalize_grad_value(g, y, dot, dot_scaled, p, grad_factor):
    """((g - y * dot) * grad_factor) * p: grad_factor before p, a 0 factor must
    not meet an overflowed product (inf * 0). Where dot (a GradSum) overflowed,
    at its scale 2^-64; where g - y * dot overflowed, at half scale."""
    d = g - y * dot
    plain = (d * grad_factor) * p
    halved = (((0.5 * g - y * (0.5 * dot)) * grad_factor) * p) * 2.0
    at_scale = (((g * grad_sum_scale() - y * dot_scaled) * grad_factor) * p) * grad_sum_unscale()
    return torch.where(grad_sum_overflowed(dot, dot_scaled), at_scale,
                       torch.where(torch.isinf(d), halved, plain))


def cosine_grad_value(g, v_self, v_other, c, p_self, grad_factor_self):
    return g * (((v_other - c * v_self) * grad_factor_self) * p_self)


def _saturate_to(x, dtype):
    # A gradient beyond `dtype`'s largest finite value (float16: vectors of norm
    # at least eps but under 1.5e-5) saturates rather than rounding to inf; NaN stays.
    return saturate(x, nf_largest(dtype))


def _vector_state(x, eps):
    """(scaled entries, p, q, divisor, unit_divisor, grad_factor) of each
    vector (last dim) of x."""
    if x.shape[-1]:
        amax = x.abs().amax(dim=-1, keepdim=True)
        p = norm_scale(amax)
    else:
        amax = torch.zeros(x.shape[:-1] + (1,), dtype=x.dtype, device=x.device)
        p = torch.ones_like(amax)
    s = scaled_entry(x, p)
    ssq = (s * s).sum(dim=-1, keepdim=True)
    q, divisor, grad_factor = norm_factors(p, ssq, eps)
    return s, p, q, divisor, unit_divisor(divisor, p, amax), grad_factor


def normalize(input, eps):
    check_normalize(input, eps)
    x = _acc(input)
    s, p, q, _, unit, grad_factor = _vector_state(x, effective_eps(eps, x.dtype))
    stats = torch.cat([p, grad_factor], dim=-1)
    return normalized_entry(s, unit, q).to(input.dtype).contiguous(), stats


def normalize_backward(grad_output, output, stats):
    check_normalize_backward(grad_output, output, stats)
    g, y = _acc(grad_output), _acc(output)
    p, grad_factor = stats[..., :1], stats[..., 1:]
    dot = (g * y).sum(dim=-1, keepdim=True)
    dot_scaled = ((g * grad_sum_scale()) * y).sum(dim=-1, keepdim=True)
    grad = normalize_grad_value(g, y, dot, dot_scaled, p, grad_factor)
    return _saturate_to(grad, output.dtype).to(output.dtype).contiguous()


def cosine_similarity(x1, x2, eps):
    check_cosine(x1, x2, eps)
    a, b = _acc(x1), _acc(x2)
    eps = effective_eps(eps, a.dtype)
    s1, p1, q1, divisor1, unit1, gf1 = _vector_state(a, eps)
    s2, p2, q2, divisor2, unit2, gf2 = _vector_state(b, eps)
    c = cosine_value((s1 * s2).sum(dim=-1, keepdim=True), divisor1, divisor2, q1, q2)
    stats = torch.cat([p1, q1, unit1, gf1, p2, q2, unit2, gf2], dim=-1)
    return c.squeeze(-1).to(x1.dtype).contiguous(), stats


def cosine_similarity_backward(grad_output, x1, x2, output, stats):
    check_cosine_backward(grad_output, x1, x2, output, stats)
    p1, q1, unit1, gf1, p2, q2, unit2, gf2 = (stats[..., k:k + 1] for k in range(8))
    v1 = normalized_entry(scaled_entry(_acc(x1), p1), unit1, q1)
    v2 = normalized_entry(scaled_entry(_acc(x2), p2), unit2, q2)
    g, c = _acc(grad_output).unsqueeze(-1), _acc(output).unsqueeze(-1)
    dx1 = cosine_grad_value(g, v1, v2, c, p1, gf1)
    dx2 = cosine_grad_value(g, v2, v1, c, p2, gf2)
    return (_saturate_to(dx1, x1.dtype).to(x1.dtype).contiguous(),
            _saturate_to(dx2, x2.dtype).to(x2.dtype).contiguous())


def cos_sim_matrix(a, b):
    check_cos_sim_matrix(a, b)
    return cosine_clamp(a @ b.T)
