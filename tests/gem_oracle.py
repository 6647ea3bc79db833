"""A float64 oracle of GeM pooling written from DESIGN.md's rules (section 2,
gem), independent of every backend's code: the generalized mean taken in the
log domain, log gem = (logsumexp(p * log max(x, eps)) - log n) / p, in torch
float64 operations so that torch.autograd gives its gradients for x and p.

Rules applied on top of the formula, per reduction:
- no kept entry: 0 (gradients 0);
- a kept +inf entry: +inf (gradients 0);
- a kept NaN entry: NaN (its gradients are checked by the rule, not here);
- an entry at or below eps gets gradient 0;
- a tensor p is clamped to [1e-2, 1e2], its gradient 0 beyond the bounds and
  passed at them (p_used).
"""

import math

import torch

P_MIN, P_MAX = 1e-2, 1e2


def p_used(p, acc=torch.float32):
    """The p the op computes with: a tensor is clamped in the op's accumulation
    dtype `acc` (float32 for fp16/bf16/fp32 inputs, float64 for float64 ones;
    float32's bound 1e-2 is 0.0099999998), its gradient passed inside and at the
    bounds, 0 beyond (torch.clamp's up to torch 2.13; 2.14 passes none at the
    bounds, so the oracle spells it out); a float is taken as is."""
    if isinstance(p, torch.Tensor):
        pa = p.to(acc).reshape(())
        inside = (pa.detach() >= P_MIN) & (pa.detach() <= P_MAX)
        return torch.where(inside, pa, pa.detach().clamp(P_MIN, P_MAX)).double()
    return torch.tensor(float(p), dtype=torch.float64)


def gem(x, p, dim, eps, mask=None, acc=torch.float32):
    """gem over `dim` (int or tuple) of float64 x, differentiable in x and a tensor p.
    Returns the output (keepdim=False) with the special rows' rules applied."""
    x = x.to(torch.float64)
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    keep = torch.ones_like(x, dtype=torch.bool) if mask is None else (mask != 0).expand(x.shape)
    pv = p_used(p, acc)
    # max(x, eps) passing gradient only above eps (the rule); torch.clamp's
    # gradient at the bound itself differs between torch versions (1 up to 2.13).
    c = torch.where(x > eps, x, x.detach().clamp(min=eps))
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



def input_gradient(x, p, dim, eps, out, g, mask=None, acc=torch.float32):
    """d(sum g * out)/dx of the oracle's finite, nonempty reductions, in closed
    form and in the log domain: g * out^(1-p) * x^(p-1) / n for a kept entry
    above eps, 0 elsewhere. Autograd of gem() forms it as out * exp(z - lse) / x,
    whose middle factor underflows (1e-600 for x = [1e300, 1], p = 2) where the
    gradient itself (7e-301) does not; this form does not."""
    x = x.detach().to(torch.float64)
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    keep = torch.ones_like(x, dtype=torch.bool) if mask is None else (mask != 0).expand(x.shape)
    pv = p_used(p.detach() if isinstance(p, torch.Tensor) else p, acc)
    n = keep.sum(dim=dims, keepdim=True).to(torch.float64)
    out, g = out.detach().double(), torch.as_tensor(g, dtype=torch.float64)
    for d in sorted(d % x.dim() for d in dims):
        out, g = out.unsqueeze(d), g.unsqueeze(d)
    live = keep & (x > eps) & torch.isfinite(x) & torch.isfinite(out) & (out > 0) & (g != 0)
    safe = lambda t, fill: torch.where(live, t, fill)
    log_mag = (torch.log(safe(g.abs().expand(x.shape), 1.0)) + (1 - pv) * torch.log(safe(out.expand(x.shape), 1.0))
               + (pv - 1) * torch.log(safe(x, 1.0)) - torch.log(n.expand(x.shape)))
    return torch.where(live, torch.sign(g) * torch.exp(log_mag), 0.0)

# --- inputs shared by the GeM tests ----------------------------------------------------


def plain_row(n, shift=0.0):
    """n ordinary activations in [0.5, 2.5]."""
    return [1.5 + math.sin(0.7 * i + shift) for i in range(n)]


def distribution_rows(kind, b, n, gen):
    """b rows of n float64 entries of a given shape of distribution: "sin" (plain
    rows), "abs normal", "relu" (about half the entries clamped to eps: eps^p
    enters p's gradient) or "log-normal" (ratios down to 1e-7)."""
    if kind == "sin":
        return torch.tensor([plain_row(n, 0.3 * i) for i in range(b)], dtype=torch.float64)
    z = torch.randn(b, n, generator=gen, dtype=torch.float64)
    if kind == "abs normal":
        return z.abs()
    if kind == "relu":
        return z.clamp(min=0)
    assert kind == "log-normal", kind
    return torch.exp(2.0 * z)
