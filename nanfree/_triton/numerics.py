"""Triton mirror of csrc/include/nanfree/numerics.h (same names, same rules),
shared by the Triton kernels of every family: the math functions and type
limits of the header (the C library's functions: libdevice's when compiled; in
the interpreter, which has none, numpy's or a float64 evaluation), saturation,
the effective eps, and the online logsumexp state.

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
from triton.language.extra import libdevice

from .common import kernels_interpreted


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


# ---------------------------------------------------------------------------
# Math functions and type limits. COMPILED (at the end of this module) says
# whether the kernels are compiled, with libdevice, or interpreted.
# ---------------------------------------------------------------------------


@triton.jit
def nf_exp(x):
    if COMPILED:
        return libdevice.exp(x)
    else:
        return tl.exp(x)  # numpy's, in the interpreter


@triton.jit
def nf_log(x):
    """log of the C library: libdevice's when compiled (within one ulp); in the
    interpreter in float64 (numpy's float32 log is up to 3 ulp off next to 1)."""
    if COMPILED:
        return libdevice.log(x)
    else:
        return tl.log(x.to(tl.float64)).to(x.dtype)


@triton.jit
def nf_log1p(x):
    """log1p of the C library: libdevice's when compiled; in the interpreter
    (no libdevice) log(1 + x) * (x / ((1 + x) - 1)) in float64."""
    if COMPILED:
        return libdevice.log1p(x)
    else:
        xd = x.to(tl.float64)
        u = 1.0 + xd
        # u == 1: x below half an ulp of 1, where log1p(x) = x; u = +inf: log(inf) * inf / inf
        # would be NaN; the identity is exact otherwise up to a few roundings of float64.
        v = tl.where(u == 1.0, xd, tl.log(u) * (xd / (u - 1.0)))
        v = tl.where(xd == float("inf"), xd, v)
        return v.to(x.dtype)


@triton.jit
def nf_pow(x, y):
    """pow(x, y) of the C library for x >= 0 (or NaN): libdevice's when
    compiled; in the interpreter (no libdevice) exp(y log x) in float64."""
    if COMPILED:
        return libdevice.pow(x, y)
    else:
        xd = x.to(tl.float64)
        yd = y.to(tl.float64)
        v = tl.exp(yd * tl.log(xd))
        # C's pow(x, 0) and pow(1, y) are 1 even for a 0, inf or NaN other
        # operand, where y log x would be 0 * inf or NaN. (Two wheres: y may be
        # 0-d, and the interpreter cannot `|` a 0-d bool with a tensor.)
        v = tl.where(xd == 1.0, 1.0, tl.where(yd == 0.0, 1.0, v))
        return v.to(x.dtype)


@triton.jit
def nf_sqrt(x):
    # Rounded to nearest, as sqrtf / sqrt (Triton's float32 tl.sqrt is approximate).
    if x.dtype == tl.float64:
        return tl.sqrt(x)
    else:
        return tl.sqrt_rn(x)


@triton.jit
def nf_tiny(x):
    """The smallest positive normal of x's dtype (float32 or float64)."""
    if x.dtype == tl.float64:
        return 2.2250738585072014e-308
    else:
        return 1.1754943508222875e-38


@triton.jit
def nf_largest(x):
    """The largest finite value of x's dtype (float32 or float64)."""
    if x.dtype == tl.float64:
        return 1.7976931348623157e308
    else:
        return 3.4028234663852886e38


@triton.jit
def largest_finite(ptr):
    """The largest finite value of ptr's element dtype (float64's held as a
    float64): the bound of a saturated output stored there."""
    if ptr.dtype.element_ty == tl.float16:
        return 65504.0
    elif ptr.dtype.element_ty == tl.bfloat16:
        return 3.3895313892515355e38
    elif ptr.dtype.element_ty == tl.float32:
        return 3.4028234663852886e38
    else:
        return tl.full([], 1.7976931348623157e308, tl.float64)


@triton.jit
def min_normal_exponent(x):
    """Exponent range of the normal numbers of x's dtype: 2^e is normal for e in [min, max]."""
    if x.dtype == tl.float64:
        return -1022
    else:
        return -126  # float32


@triton.jit
def max_normal_exponent(x):
    if x.dtype == tl.float64:
        return 1023
    else:
        return 127  # float32


@triton.jit
def _ilogb_bits(x, INT: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
                LIFT: tl.constexpr):
    """nf_ilogb of a float of MANT mantissa bits and exponent bias BIAS, whose
    bits read as INT; LIFT = 2^(MANT + 1)."""
    # A subnormal (exponent field 0) is first lifted by the exact factor LIFT
    # into the normals, where the exponent field tells its exponent.
    lift = (x.to(INT, bitcast=True) >> MANT) == 0
    y = tl.where(lift, x * LIFT, x)
    field = ((y.to(INT, bitcast=True) >> MANT) & (2 * BIAS + 1)).to(tl.int32)
    return field - BIAS - tl.where(lift, MANT + 1, 0)


@triton.jit
def nf_ilogb(x):
    """ilogb(x) (the exponent e of x = m * 2^e, 1 <= m < 2) for x > 0 finite,
    read from the exponent bits (Triton's interpreter has no libdevice); the
    caller gives 0, inf and NaN no exponent."""
    if x.dtype == tl.float64:
        return _ilogb_bits(x, tl.int64, 52, 1023, 9007199254740992.0)
    else:
        return _ilogb_bits(x, tl.int32, 23, 127, 16777216.0)


@triton.jit
def _pow2_bits(e, INT: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr):
    """The bits (as INT) of 2^e, normal or subnormal, for a float of MANT
    mantissa bits and exponent bias BIAS."""
    ei = tl.cast(e, INT)
    normal = (ei + BIAS) << MANT
    # A subnormal power of two is one mantissa bit; the shift is kept >= 0 where unused.
    subnormal = tl.full(ei.shape, 1, INT) << tl.maximum(ei + (BIAS - 1 + MANT), 0)
    return tl.where(ei >= 1 - BIAS, normal, subnormal)


@triton.jit
def nf_ldexp(x, e):
    """x * 2^e for an int32 e such that 2^e is a float of x's dtype, normal or
    subnormal (e in [min_normal_exponent - mantissa bits, max_normal_exponent]):
    the power of two is built from its bits, so it is exact."""
    if x.dtype == tl.float64:
        return x * _pow2_bits(e, tl.int64, 52, 1023).to(tl.float64, bitcast=True)
    else:
        return x * _pow2_bits(e, tl.int32, 23, 127).to(tl.float32, bitcast=True)


# A GradSum's second sum of upstream gradients is at the scale 2^-64 (kGradSumShift).
GRAD_SUM_SCALE = tl.constexpr(2.0 ** -64)
GRAD_SUM_UNSCALE = tl.constexpr(2.0 ** 64)


@triton.jit
def grad_sum_overflowed(plain, scaled):
    # A row sum of upstream gradients overflowed (to +-inf, or NaN once partial
    # sums of both signs did) while its twin at the scale 2^-64 holds it.
    return tl.where(tl.abs(plain) < float("inf"), False, tl.abs(scaled) < float("inf"))


@triton.jit
def saturate(x, bound):
    # x within [-bound, bound] (a gradient must stay finite); NaN stays NaN.
    return tl.where(x > bound, bound, tl.where(x < -bound, -bound, x))


@triton.jit
def effective_eps(eps):
    # An eps below the accumulation type's smallest normal is raised to it, so
    # 1/eps, log(eps) and m / eps stay finite.
    tiny = nf_tiny(eps)
    return tl.where(eps < tiny, tiny, eps)


# Whether this process's kernels are compiled (libdevice) rather than
# interpreted: Triton's mode is fixed when a kernel is defined, as this
# module's functions were.
COMPILED = tl.constexpr(not kernels_interpreted((lse_scale,)))
