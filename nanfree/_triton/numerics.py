"""Triton mirror of csrc/include/nanfree/numerics.h (same names, same rules).

An online logsumexp state is a pair (max, sum): `max` is the largest value seen
(-inf for the empty set, never NaN) and `sum` is sum(exp(v - max)); when max is
+inf, `sum` counts the +inf entries, and a NaN value makes `sum` NaN.
"""

import triton
import triton.language as tl


@triton.jit
def lse_scale(a, b):
    # exp(a - b) for a <= b; equal arguments give exactly 1, also when both are
    # +inf, where a - b would be inf - inf = NaN.
    return tl.where(a == b, 1.0, tl.exp(a - b))


@triton.jit
def lse_merge(max_a, sum_a, max_b, sum_b):
    """State of the union of two disjoint sets (elementwise on tensors)."""
    m = tl.where(max_a > max_b, max_a, max_b)
    # lse_scale keeps equal maxima (both -inf for two empty sets, or both +inf)
    # at a factor 1 instead of exp(NaN).
    return m, sum_a * lse_scale(max_a, m) + sum_b * lse_scale(max_b, m)


@triton.jit
def lse_value(m, s):
    # log(sum(exp(v))): -inf for the empty set (-inf + log 0), +inf when a value
    # is +inf, NaN when a value is NaN.
    return m + tl.log(s)


@triton.jit
def lse_block_state(x):
    """State of a 1-D block of values (the lse_update loop of numerics.h)."""
    # NaN is left out of the max (it must never be NaN); it reaches `sum` below.
    m = tl.max(tl.where(x == x, x, float("-inf")), axis=0)
    # -inf adds exp(-inf) = 0; lse_scale would count it as 1 against an all -inf
    # block's max. A NaN x gives lse_scale = exp(NaN) = NaN, so `sum` is NaN.
    terms = tl.where(x == float("-inf"), 0.0, lse_scale(x, m))
    return m, tl.sum(terms, axis=0)
