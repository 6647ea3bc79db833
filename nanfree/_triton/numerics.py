"""Triton mirror of csrc/include/nanfree/numerics.h (same names, same rules).

An online logsumexp state is a pair (max, sum): `max` is the largest value seen
(-inf for the empty set, never NaN) and `sum` is sum(exp(v - max)); when max is
+inf, `sum` counts the +inf entries, and a NaN value makes `sum` NaN.

numerics.h adds values one at a time (lse_update); a Triton block adds a whole
block at once: the block's max first, then one term per value. The two rules
of lse_update are written once, as lse_update_max_candidate and
lse_update_term, and shared by the 1-D block reduction (lse_block_state) and
its 2-D sibling that reduces a [BLOCK_J, BLOCK_I] tile along axis 0
(lse_tile_state_axis0: one state per column i of the tile).
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
def lse_update_max_candidate(x):
    """What x offers to the state's max (lse_update's `x > state.max`)."""
    # NaN is left out of the max (the max is never NaN); it reaches `sum`
    # through lse_update_term instead.
    return tl.where(x == x, x, float("-inf"))


@triton.jit
def lse_update_term(x, m):
    """What x adds to `sum` once the max m of its set is known (lse_update)."""
    # -inf adds exp(-inf) = 0; lse_scale would count it as 1 against an all
    # -inf set's max. A NaN x gives lse_scale = exp(NaN) = NaN, so `sum` is NaN.
    return tl.where(x == float("-inf"), 0.0, lse_scale(x, m))


@triton.jit
def lse_block_state(x):
    """State of a 1-D block of values (the lse_update loop of numerics.h)."""
    m = tl.max(lse_update_max_candidate(x), axis=0)
    return m, tl.sum(lse_update_term(x, m), axis=0)


@triton.jit
def lse_tile_state_axis0(x):
    """lse_block_state of each column of a 2-D tile [BLOCK_J, BLOCK_I], reduced
    along axis 0: one state (max, sum) per column, each of shape [BLOCK_I]."""
    m = tl.max(lse_update_max_candidate(x), axis=0)
    return m, tl.sum(lse_update_term(x, m[None, :]), axis=0)
