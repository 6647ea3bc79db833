"""Mirror of csrc/include/nanfree/numerics.h in plain torch operations (same
names, same rules), shared by every family of the pure-PyTorch backend.

The functions work elementwise on tensors; the header's one-value-at-a-time
online state (lse_update) becomes lse_state, the state of a whole dimension.
Both branches of a torch.where are evaluated: these functions are never
differentiated by autograd, so an unused inf or NaN branch is harmless.
"""

import torch

from .._ops.common import acc_dtype  # noqa: F401  (the families import it from here)

INF = float("inf")


def nf_tiny(dtype):
    """The smallest positive normal of dtype."""
    return torch.finfo(dtype).tiny


def nf_largest(dtype):
    """The largest finite value of dtype (the bound of a saturated output of it)."""
    return torch.finfo(dtype).max


def saturate(x, bound):
    """x within [-bound, bound]; NaN stays NaN (torch.clamp keeps it)."""
    return x.clamp(-bound, bound)


GRAD_SUM_SHIFT = 64  # kGradSumShift


def grad_sum_scale():
    """The scale of a GradSum's second sum of upstream gradients."""
    return 2.0 ** -GRAD_SUM_SHIFT


def grad_sum_unscale():
    return 2.0 ** GRAD_SUM_SHIFT


def grad_sum_overflowed(plain, scaled):
    """A row sum of upstream gradients overflowed (to +-inf, or NaN once partial
    sums of both signs did) while its twin at the scale 2^-64 holds it."""
    return ~torch.isfinite(plain) & torch.isfinite(scaled)


def effective_eps(eps, dtype):
    """An eps below dtype's smallest normal is raised to it (1/eps, log(eps) finite)."""
    return max(eps, nf_tiny(dtype))


def lse_scale(a, b):
    """exp(a - b) for a <= b; exactly 1 where a == b (also both +inf, where
    a - b would be inf - inf = NaN)."""
    return torch.where(a == b, 1.0, torch.exp(a - b))


def lse_state(x, dim):
    """The online logsumexp state (max, sum) of x along dim (kept as size 1),
    and each entry's term of the sum. max is never NaN; a NaN entry makes sum
    NaN; -inf entries add 0, also when the max is -inf too."""
    if x.shape[dim] == 0:
        shape = list(x.shape)
        shape[dim] = 1
        return x.new_full(shape, -INF), x.new_zeros(shape), x
    # NaN must not become the max (it reaches sum through its term instead).
    row_max = torch.where(torch.isnan(x), -INF, x).amax(dim=dim, keepdim=True)
    terms = torch.where(x == -INF, 0.0, lse_scale(x, row_max))
    return row_max, terms.sum(dim=dim, keepdim=True), terms


def lse_value(state_max, state_sum):
    """log(sum(exp(v))): -inf for the empty set, +inf with a +inf entry, NaN with a NaN one."""
    return state_max + torch.log(state_sum)
