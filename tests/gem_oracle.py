"""A float64 oracle of GeM pooling written from DESIGN.md's rules (section 2,
gem), independent of every backend's code: the generalized mean taken in the
log domain, log gem = (logsumexp(p * log max(x, eps)) - log n) / p, in torch
float64 operations so that torch.autograd gives its gradients for x and p.

Rules applied on top of the formula, per reduction:
- no kept entry: 0 (gradients 0);
- a kept +inf entry: +inf (gradients 0);
- a kept NaN entry: NaN (its gradients are checked by the rule, not here);
- a tensor p is torch.clamp'ed to [1e-2, 1e2] (autograd then zeroes its
  gradient outside, as torch.clamp's backward does).
"""

import math

import torch

P_MIN, P_MAX = 1e-2, 1e2


def p_used(p, acc=torch.float32):
    """The p the op computes with: a tensor is clamped in the op's accumulation
    dtype `acc` (float32 for fp16/bf16/fp32 inputs, float64 for float64 ones;
    float32's bound 1e-2 is 0.0099999998), a float is taken as is."""
    if isinstance(p, torch.Tensor):
        return torch.clamp(p.to(acc).reshape(()), P_MIN, P_MAX).double()
    return torch.tensor(float(p), dtype=torch.float64)


def gem(x, p, dim, eps, mask=None, acc=torch.float32):
    """gem over `dim` (int or tuple) of float64 x, differentiable in x and a tensor p.
    Returns the output (keepdim=False) with the special rows' rules applied."""
    x = x.to(torch.float64)
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    keep = torch.ones_like(x, dtype=torch.bool) if mask is None else (mask != 0).expand(x.shape)
    pv = p_used(p, acc)
    c = torch.clamp(x, min=eps)
    # Special entries are kept out of the formula (their rows are overridden
    # below), so they put no NaN into the autograd graph of the other rows.
    regular = keep & torch.isfinite(c)
    logc = torch.log(torch.where(regular, c, 1.0))
    z = torch.where(regular, pv * logc, -math.inf)
    n = keep.sum(dim=dims).to(torch.float64)
    lse = torch.logsumexp(z, dim=dims)
    safe_n = torch.where(n > 0, n, 1.0)
    safe_lse = torch.where(n > 0, lse, 0.0)
    out = torch.exp((safe_lse - torch.log(safe_n)) / pv)
    has_inf = (keep & (x == math.inf)).any(dim=dims)
    has_nan = (keep & torch.isnan(x)).any(dim=dims)
    # Rules: empty -> 0 and +inf -> +inf (no gradient: a constant, detached).
    out = torch.where(n == 0, 0.0, out)
    out = torch.where(has_inf, math.inf, out)
    # NaN -> NaN (the tests check a NaN row's gradients by the rule directly).
    out = torch.where(has_nan, math.nan, out)
    return out
