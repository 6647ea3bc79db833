"""Triton kernels of the elementwise family: the unary ops sqrt, log, log1p, acos,
asin, the binary ops pow, atan2, div_no_nan, xlogy, xlog1py, and their
<op>_backward, mirroring csrc/include/nanfree/elementwise_math.h and
elementwise_binary_math.h by name (value and derivatives per op, chain_rule),
one launcher per op named as the op.

Inputs are flat: dense tensors of one layout are read as they are (the output
takes their strides), others as contiguous copies. Elements are computed in
the accumulation dtype (float32 for float16 and bfloat16) and rounded once.

The C library functions come from libdevice when compiled. Triton's
interpreter has no libdevice: there log1p, asin and acos are evaluated in
float64 from functions it has (numpy's log, sin and cos): log1p by
log(1 + x) * (x / ((1 + x) - 1)), asin by Newton's method on sin after the
reduction asin(x) = pi/2 - 2 asin(sqrt((1 - |x|) / 2)) for |x| > 1/2 (where
1 - |x| is exact), acos from asin by the matching identities, atan2 from asin
of the smaller coordinate over the radius (an argument at most 1/sqrt(2)),
pow of a negative base as the power of |x| with the sign of an odd exponent.
Binary ops read an operand of one element at every position (step 0); other
broadcast operands are copied into the output's layout first.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .._ops import elementwise as _ew
from .._ops.common import acc_dtype
from . import common
from .common import device_guard
from .element_io import ieee_div, load_acc, store_rounded
from .numerics import COMPILED, largest_finite, nf_log, nf_log1p, nf_pow, nf_sqrt, saturate

_BLOCK = 1024
_HALF_PI = tl.constexpr(1.5707963267948966)
_PI = tl.constexpr(3.141592653589793)


# --- the C library's functions ------------------------------------------------------


@triton.jit
def _asin_small_f64(z):
    """asin(z) for |z| <= 1/2 in float64 (interpreter): Newton's method on sin from
    the series' first two terms (error below 3e-3, then 1e-5, 1e-10, 1e-20)."""
    y = z + z * z * z / 6.0
    for _ in tl.static_range(4):
        y = y - (tl.sin(y) - z) / tl.cos(y)
    return y


@triton.jit
def _asin_f64(xd):
    """asin(x) for x in [-1, 1] (or NaN) in float64 (interpreter)."""
    a = tl.abs(xd)
    big = a > 0.5
    # 1 - |x| is exact for |x| > 1/2 (Sterbenz); the inner argument is at most 1/2.
    inner = _asin_small_f64(tl.where(big, tl.sqrt((1.0 - a) * 0.5), xd))
    far = _HALF_PI - 2.0 * inner
    return tl.where(big, tl.where(xd < 0, -far, far), inner)


@triton.jit
def nf_asin(x):
    if COMPILED:
        return libdevice.asin(x)
    else:
        return _asin_f64(x.to(tl.float64)).to(x.dtype)


@triton.jit
def nf_acos(x):
    if COMPILED:
        return libdevice.acos(x)
    else:
        xd = x.to(tl.float64)
        # acos(x) = 2 asin(sqrt((1 - x) / 2)) for x > 1/2, pi - 2 asin(sqrt((1 + x) / 2))
        # for x < -1/2 (both exact differences), pi/2 - asin(x) between.
        near_one = 2.0 * _asin_small_f64(tl.sqrt((1.0 - tl.minimum(xd, 1.0)) * 0.5))
        near_minus_one = _PI - 2.0 * _asin_small_f64(tl.sqrt((1.0 + tl.maximum(xd, -1.0)) * 0.5))
        middle = _HALF_PI - _asin_small_f64(tl.minimum(tl.maximum(xd, -0.5), 0.5))
        v = tl.where(xd > 0.5, near_one, tl.where(xd < -0.5, near_minus_one, middle))
        return tl.where(xd != xd, xd, v).to(x.dtype)


# --- elementwise_math.h, by name ------------------------------------------------------


@triton.jit
def sqrt_domain(x):
    return tl.where(x < 0, 0.0, x).to(x.dtype)  # below the domain: sqrt(0) (rule 2)


@triton.jit
def sqrt_value(x):
    return nf_sqrt(sqrt_domain(x))


@triton.jit
def sqrt_derivative(x):
    # x < 0: outside the domain (rule 2); x == 0: 1 / (2 sqrt(0)) is infinite (rule 3).
    return tl.where(x <= 0, 0.0, ieee_div(0.5, nf_sqrt(x)))


@triton.jit
def sqrt_second_derivative(x):
    return tl.where(x <= 0, 0.0, ieee_div(-0.25, x * nf_sqrt(x)))  # 0 where the derivative is


@triton.jit
def log_domain(x):
    return tl.where(x < 0, 0.0, x).to(x.dtype)  # below the domain: log(0) = -inf (rule 2)


@triton.jit
def log_value(x):
    return nf_log(log_domain(x))


@triton.jit
def log_derivative(x):
    return tl.where(x <= 0, 0.0, ieee_div(1.0, x))  # outside the domain, or 1/0 (rules 2, 3)


@triton.jit
def log_second_derivative(x):
    return tl.where(x <= 0, 0.0, ieee_div(-1.0, x * x))  # 0 where the derivative is


@triton.jit
def log1p_domain(x):
    return tl.where(x < -1, -1.0, x).to(x.dtype)  # below the domain: log1p(-1) = -inf (rule 2)


@triton.jit
def log1p_value(x):
    return nf_log1p(log1p_domain(x))


@triton.jit
def log1p_derivative(x):
    return tl.where(x <= -1, 0.0, ieee_div(1.0, x + 1))  # outside the domain, or 1/0


@triton.jit
def log1p_second_derivative(x):
    u = x + 1
    return tl.where(x <= -1, 0.0, ieee_div(-1.0, u * u))  # 0 where the derivative is


@triton.jit
def unit_clamp(x):
    # x clamped to [-1, 1]; NaN stays NaN (both comparisons are false).
    return tl.where(x < -1, -1.0, tl.where(x > 1, 1.0, x)).to(x.dtype)


@triton.jit
def unit_rsqrt(x):
    return ieee_div(1.0, nf_sqrt((1 - x) * (1 + x)))  # exact 1 -+ x near +-1


@triton.jit
def acos_domain(x):
    return unit_clamp(x)  # beyond +-1: acos of +-1 (rule 2)


@triton.jit
def acos_value(x):
    return nf_acos(acos_domain(x))


@triton.jit
def acos_derivative(x):
    # |x| > 1: outside the domain; |x| == 1: -1 / sqrt(0) is infinite (rules 2 and 3).
    return tl.where(tl.abs(x) >= 1, 0.0, -unit_rsqrt(x))


@triton.jit
def acos_second_derivative(x):
    outside = tl.abs(x) >= 1  # 0 where the derivative is
    r = unit_rsqrt(tl.where(outside, 0.0, x).to(x.dtype))
    return tl.where(outside, 0.0, -x * r * r * r)


@triton.jit
def asin_domain(x):
    return unit_clamp(x)  # beyond +-1: asin of +-1 (rule 2)


@triton.jit
def asin_value(x):
    return nf_asin(asin_domain(x))


@triton.jit
def asin_derivative(x):
    return tl.where(tl.abs(x) >= 1, 0.0, unit_rsqrt(x))  # as acos's (rules 2 and 3)


@triton.jit
def asin_second_derivative(x):
    outside = tl.abs(x) >= 1  # 0 where the derivative is
    r = unit_rsqrt(tl.where(outside, 0.0, x).to(x.dtype))
    return tl.where(outside, 0.0, x * r * r * r)


@triton.jit
def unary_function(x, OP: tl.constexpr, ORDER: tl.constexpr):
    """The op's value (ORDER 0), derivative (1) or second derivative (2); OP is the
    index of UnaryOp (sqrt, log, log1p, acos, asin)."""
    if OP == 0:
        if ORDER == 0:
            v = sqrt_value(x)
        elif ORDER == 1:
            v = sqrt_derivative(x)
        else:
            v = sqrt_second_derivative(x)
    elif OP == 1:
        if ORDER == 0:
            v = log_value(x)
        elif ORDER == 1:
            v = log_derivative(x)
        else:
            v = log_second_derivative(x)
    elif OP == 2:
        if ORDER == 0:
            v = log1p_value(x)
        elif ORDER == 1:
            v = log1p_derivative(x)
        else:
            v = log1p_second_derivative(x)
    elif OP == 3:
        if ORDER == 0:
            v = acos_value(x)
        elif ORDER == 1:
            v = acos_derivative(x)
        else:
            v = acos_second_derivative(x)
    else:
        if ORDER == 0:
            v = asin_value(x)
        elif ORDER == 1:
            v = asin_derivative(x)
        else:
            v = asin_second_derivative(x)
    return v.to(x.dtype)


@triton.jit
def chain_rule(g, d, bound):
    # g * d: 0 where d or g is 0 and neither is NaN (a derivative counted 0 stays 0
    # against an infinite g; a zero g against an infinite d), saturated to +-bound
    # (rule 5); NaN g or d gives NaN (rule 7).
    zero = ((d == 0) | (g == 0)) & (d == d) & (g == g)
    masked = tl.where(zero, 0.0, g * d)
    # beyond the range (an infinite d or g): +-bound; NaN stays.
    return saturate(masked, bound)


@triton.jit
def log_gradient(g, x, bound):
    # chain_rule(g, log_derivative(x), bound) as g / x (one rounding): 0 where the
    # derivative is 0 (x <= 0; x beyond bound is +inf) unless g is NaN (an infinite g
    # would make inf / inf), else g / x saturated (rule 5); NaN passes (rule 7).
    zero = ((x <= 0) | (x > bound)) & (g == g)
    return saturate(tl.where(zero, 0.0, ieee_div(g, x)), bound)


@triton.jit
def unary_element(g, x, bound, OP: tl.constexpr, ORDER: tl.constexpr):
    if ORDER == 0:
        return unary_function(x, OP, 0)
    elif OP == 1 and ORDER == 1:  # log's gradient
        return log_gradient(g, x, bound)
    else:
        return chain_rule(g, unary_function(x, OP, ORDER), bound)


@triton.jit
def _unary_kernel(grad_ptr, x_ptr, out_ptr, n, OP: tl.constexpr, ORDER: tl.constexpr,
                  ACC: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = load_acc(x_ptr, offs, inside, ACC)
    if ORDER == 0:
        g = x
    else:
        g = load_acc(grad_ptr, offs, inside, ACC)
    y = unary_element(g, x, largest_finite(out_ptr), OP, ORDER)
    store_rounded(out_ptr, offs, y.to(ACC), inside)


# --- the binary ops: elementwise_binary_math.h, by name ----------------------------------


@triton.jit
def nf_floor(x):
    return tl.floor(x)


@triton.jit
def _sign_bit(x):
    """Whether x's sign bit is set (-0.0 included), from its bits."""
    if x.dtype == tl.float64:
        return x.to(tl.int64, bitcast=True) < 0
    else:
        return x.to(tl.int32, bitcast=True) < 0


@triton.jit
def _atan2_f64(a, b):
    """C's atan2(a, b) in float64 (interpreter), from asin of an argument at most
    1/sqrt(2) in size: the angle from the b axis (|b| >= |a|) or from the a axis."""
    inf = float("inf")
    s = tl.maximum(tl.abs(a), tl.abs(b))
    # Infinite inputs: the direction of the limit (C: atan2(inf, inf) = pi/4, and a
    # finite input against an infinite one counts 0 of its sign).
    a = tl.where(s == inf, tl.where(tl.abs(a) == inf, tl.where(a > 0, 1.0, -1.0), a * 0.0), a)
    b = tl.where(s == inf, tl.where(tl.abs(b) == inf, tl.where(b > 0, 1.0, -1.0), b * 0.0), b)
    s = tl.where((s == inf) | (s == 0), 1.0, s)  # the origin keeps its signed zeros
    x = a / s
    y = b / s
    r = tl.sqrt(x * x + y * y)
    safe = tl.where(r == 0, 1.0, r)
    from_b = tl.where(r == 0, x, _asin_f64(x / safe))  # the origin: +-0
    from_a = _asin_f64(y / safe)
    near_b = tl.where(_sign_bit(y), tl.where(_sign_bit(x), -_PI - from_b, _PI - from_b), from_b)
    near_a = tl.where(x > 0, _HALF_PI - from_a, -_HALF_PI + from_a)
    return tl.where(tl.abs(y) >= tl.abs(x), near_b, near_a)


@triton.jit
def nf_atan2(a, b):
    if COMPILED:
        return libdevice.atan2(a, b)
    else:
        v = _atan2_f64(a.to(tl.float64), b.to(tl.float64))
        return tl.where((a == a) & (b == b), v, (a + b).to(tl.float64)).to(a.dtype)


@triton.jit
def _pow_any_base(x, y):
    """C's pow(x, y) for any base (x < 0 with y an integer): libdevice's when
    compiled; in the interpreter numerics' nf_pow of |x| with the sign of x for
    an odd integer y (-0 included: pow(-0, -1) = -inf)."""
    if COMPILED:
        return libdevice.pow(x, y)
    else:
        magnitude = nf_pow(tl.abs(x), y)
        odd = (tl.floor(y * 0.5) * 2 != y) & (tl.floor(y) == y) & (tl.abs(y) != float("inf"))
        return tl.where(_sign_bit(x) & odd, -magnitude, magnitude)


@triton.jit
def propagate_nan(a, b, r):
    # r where neither input is NaN, else NaN (rule 7, before every other rule).
    return tl.where((a == a) & (b == b), r, a + b)


@triton.jit
def is_infinite(x):
    # x - x is NaN only for an infinite or NaN x.
    return ((x - x) != (x - x)) & (x == x)


@triton.jit
def zero_dominant_product(a, b):
    # a * b, 0 where a factor is 0 and neither is NaN (inf * 0 counts 0).
    return tl.where(((a == 0) | (b == 0)) & (a == a) & (b == b), 0.0, a * b)


@triton.jit
def pow_outside(a, b):
    # A negative base has a real power only at an integer exponent (+-inf counts).
    return (a < 0) & (nf_floor(b) != b)


@triton.jit
def pow_domain(a, b):
    return tl.where(pow_outside(a, b), 0.0, a).to(a.dtype)  # no real power: base 0 (rule 2)


@triton.jit
def pow_of_zero(b):
    # pow(0, b) for a non-integer b: 0 above 0, +inf below.
    return tl.where(b > 0, 0.0, float("inf"))


@triton.jit
def pow_value(a, b):
    # C's pow of the inputs, then outside the domain pow(0, b) (rule 2) and NaN
    # inputs NaN (rule 7).
    return propagate_nan(a, b, tl.where(pow_outside(a, b), pow_of_zero(b), _pow_any_base(a, b)))


@triton.jit
def pow_da(a, b):
    d = zero_dominant_product(b, _pow_any_base(pow_domain(a, b), b - 1))  # b a^(b-1)
    # Outside the domain (rule 2); at a == 0 below b = 1 the derivative is infinite (rule 3).
    return propagate_nan(a, b, tl.where(pow_outside(a, b) | ((a == 0) & (b < 1)), 0.0, d))


@triton.jit
def pow_db(a, b):
    pos = tl.where(a <= 0, 1.0, a).to(a.dtype)  # a <= 0: 0 below (rules 4 and 2)
    d = zero_dominant_product(nf_pow(pos, b), nf_log(pos))  # a^b log(a)
    return propagate_nan(a, b, tl.where(a <= 0, 0.0, d))


@triton.jit
def pow_daa(a, b):
    d = zero_dominant_product(b * (b - 1), _pow_any_base(pow_domain(a, b), b - 2))
    # Outside the domain; at a == 0 below b = 2 infinite or counted 0 (rules 2 and 3).
    return propagate_nan(a, b, tl.where(pow_outside(a, b) | ((a == 0) & (b < 2)), 0.0, d))


@triton.jit
def pow_dab(a, b):
    pos = tl.where(a <= 0, 1.0, a).to(a.dtype)  # a <= 0: 0 below, as pow_db (rules 2 and 4)
    d = zero_dominant_product(nf_pow(pos, b - 1), 1 + zero_dominant_product(b, nf_log(pos)))
    return propagate_nan(a, b, tl.where(a <= 0, 0.0, d))


@triton.jit
def pow_dbb(a, b):
    pos = tl.where(a <= 0, 1.0, a).to(a.dtype)  # a <= 0: 0 below, as pow_db (rules 2 and 4)
    log_a = nf_log(pos)
    d = zero_dominant_product(nf_pow(pos, b), log_a * log_a)
    return propagate_nan(a, b, tl.where(a <= 0, 0.0, d))


@triton.jit
def atan2_value(a, b):
    return nf_atan2(a, b)  # C's atan2: defined at the origin and at infinities


@triton.jit
def atan2_derivative(a, b, WHICH: tl.constexpr):
    s = tl.maximum(tl.abs(a), tl.abs(b))
    # the origin and infinite inputs: derivatives 0 (rule 3, torch's; the limit)
    s = tl.where((s == 0) | is_infinite(s), 0.0, s)
    safe = tl.where(s == 0, 1.0, s)
    x = ieee_div(a, safe)
    y = ieee_div(b, safe)
    r = x * x + y * y
    if WHICH == 0:
        d = ieee_div(ieee_div(y, r), safe)
    elif WHICH == 1:
        d = ieee_div(ieee_div(-x, r), safe)
    elif WHICH == 2:
        d = ieee_div(ieee_div(ieee_div(-2 * x * y, r * r), safe), safe)
    elif WHICH == 3:
        d = ieee_div(ieee_div(ieee_div((x - y) * (x + y), r * r), safe), safe)
    else:
        d = ieee_div(ieee_div(ieee_div(2 * x * y, r * r), safe), safe)
    return propagate_nan(a, b, tl.where(s == 0, 0.0, d))  # origin or infinity: 0


@triton.jit
def div_no_nan_zero(a, b):
    # b == 0 (rule 4), or inf / inf (no limit): 0 with every derivative.
    return (b == 0) | (is_infinite(a) & is_infinite(b))


@triton.jit
def div_no_nan_function(a, b, ORDER: tl.constexpr, PARTIAL: tl.constexpr):
    zero = div_no_nan_zero(a, b)
    safe = tl.where(zero, 1.0, b).to(b.dtype)
    q = ieee_div(a, safe)
    if ORDER == 0:
        d = q
    elif ORDER == 1 and PARTIAL == 0:
        d = ieee_div(1.0, safe)
    elif ORDER == 1:
        d = ieee_div(-q, safe)  # -(a / b) / b
    elif PARTIAL == 0:
        d = tl.zeros_like(q)  # linear in a
    elif PARTIAL == 1:
        d = ieee_div(ieee_div(-1.0, safe), safe)
    else:
        d = ieee_div(ieee_div(2 * q, safe), safe)
    return propagate_nan(a, b, tl.where(zero, 0.0, d))  # rule 4


@triton.jit
def xlog_function(a, b, SHIFT: tl.constexpr, ORDER: tl.constexpr, PARTIAL: tl.constexpr):
    """xlogy (SHIFT 0, L = log) or xlog1py (SHIFT -1, L = log1p): a L(b) and its
    derivatives (elementwise_binary_math.h's xlogy_* and xlog1py_*)."""
    edge = b <= SHIFT  # at and below the edge: derivatives 0 (rules 2 and 3)
    arg = tl.where(edge, SHIFT, b).to(b.dtype)  # below the domain: L of the edge (rule 2)
    if SHIFT == 0:
        log_b = nf_log(arg)
    else:
        log_b = nf_log1p(arg)
    u = tl.where(edge, 1.0, b - SHIFT).to(b.dtype)
    # a / u counts 0 at the edge, at a == 0 (rule 4), and for inf / inf (no limit).
    zero = edge | (a == 0) | (is_infinite(a) & is_infinite(b))
    if ORDER == 0:
        d = zero_dominant_product(a, log_b)  # 0 at a == 0 (rule 4) and along L(b) == 0
    elif ORDER == 1 and PARTIAL == 0:
        d = tl.where(edge, 0.0, log_b)
    elif ORDER == 1:
        d = tl.where(zero, 0.0, ieee_div(a, u))
    elif PARTIAL == 0:
        d = tl.zeros_like(log_b)  # linear in a
    elif PARTIAL == 1:
        d = tl.where(edge, 0.0, ieee_div(1.0, u))
    else:
        d = tl.where(zero, 0.0, ieee_div(-ieee_div(a, u), u))
    return propagate_nan(a, b, d)


@triton.jit
def binary_function(a, b, OP: tl.constexpr, ORDER: tl.constexpr, PARTIAL: tl.constexpr):
    """The op's value (ORDER 0) or its partial derivative PARTIAL of order ORDER;
    OP is the index of BinaryOp (pow, atan2, div_no_nan, xlogy, xlog1py)."""
    if OP == 0:
        if ORDER == 0:
            v = pow_value(a, b)
        elif ORDER == 1 and PARTIAL == 0:
            v = pow_da(a, b)
        elif ORDER == 1:
            v = pow_db(a, b)
        elif PARTIAL == 0:
            v = pow_daa(a, b)
        elif PARTIAL == 1:
            v = pow_dab(a, b)
        else:
            v = pow_dbb(a, b)
    elif OP == 1:
        if ORDER == 0:
            v = atan2_value(a, b)
        else:
            v = atan2_derivative(a, b, PARTIAL if ORDER == 1 else 2 + PARTIAL)
    elif OP == 2:
        v = div_no_nan_function(a, b, ORDER, PARTIAL)
    elif OP == 3:
        v = xlog_function(a, b, 0, ORDER, PARTIAL)
    else:
        v = xlog_function(a, b, -1, ORDER, PARTIAL)
    return v.to(a.dtype)


@triton.jit
def _binary_kernel(grad_ptr, a_ptr, a_step, b_ptr, b_step, out_ptr, out2_ptr, n,
                   OP: tl.constexpr, ORDER: tl.constexpr, PARTIAL: tl.constexpr,
                   BOTH: tl.constexpr, ACC: tl.constexpr, BLOCK: tl.constexpr):
    """The value (ORDER 0), one partial times grad, or (BOTH) both first-order
    gradients into out and out2 (<op>_gradients, binary_gradients of the header)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    a = load_acc(a_ptr, offs * a_step, inside, ACC)  # step 0: one element everywhere
    b = load_acc(b_ptr, offs * b_step, inside, ACC)
    if ORDER == 0:
        y = binary_function(a, b, OP, 0, 0)
    else:
        g = load_acc(grad_ptr, offs, inside, ACC)
        bound = largest_finite(out_ptr)
        if BOTH:
            store_rounded(out2_ptr, offs, chain_rule(g, binary_function(a, b, OP, 1, 1),
                                                     bound).to(ACC), inside)
            y = chain_rule(g, binary_function(a, b, OP, 1, 0), bound)
        else:
            y = chain_rule(g, binary_function(a, b, OP, ORDER, PARTIAL), bound)
    store_rounded(out_ptr, offs, y.to(ACC), inside)


KERNELS = common.KernelSet(_unary_kernel, _binary_kernel)
_check_runnable = KERNELS.check_runnable

_TL_ACC = {torch.float32: tl.float32, torch.float64: tl.float64}


def _launch(op, order, grad, x):
    out = _ew.unary_output(x)
    n = x.numel()
    if n == 0:
        return out
    acc = acc_dtype(x.dtype)
    with device_guard(x):
        _unary_kernel[(triton.cdiv(n, _BLOCK),)](
            x if grad is None else grad, x, out, n, OP=_ew.UNARY_OPS.index(op),
            ORDER=order, ACC=_TL_ACC[acc], BLOCK=_BLOCK, **common.LAUNCH)
    return out


def _unary(op, input):
    x = _ew.unary_operand(op, input)
    _check_runnable(op, x)
    (x,) = _ew.dense_operands(x)
    return _launch(op, 0, None, x)


def _unary_backward(op, grad, input, order=1):
    _ew.check_unary_backward(op, grad, input, order)
    _check_runnable(f"{op}_backward", input)
    g, x = _ew.dense_operands(grad, input)
    return _launch(op, order, g, x)


# sqrt, sqrt_backward, log, ..., asin_backward: one function per op, named as the op.
globals().update(_ew.unary_kernels(_unary, _unary_backward))


def _launch_binary(op, order, partial, grad, a, b, out, out2=None):
    n = out.numel()
    if n == 0:
        return out
    fa, a_step = common.flat_operand(a, out)
    fb, b_step = common.flat_operand(b, out)
    g = fa if grad is None else common.in_layout_of(grad, out)
    with device_guard(out):
        _binary_kernel[(triton.cdiv(n, _BLOCK),)](
            g, fa, a_step, fb, b_step, out, out if out2 is None else out2, n,
            OP=_ew.BINARY_OPS.index(op), ORDER=order, PARTIAL=partial, BOTH=out2 is not None,
            ACC=_TL_ACC[acc_dtype(out.dtype)], BLOCK=_BLOCK, **common.LAUNCH)
    return out


def _binary(op, input, other):
    a, b = _ew.binary_operands(op, input, other)
    _check_runnable(op, a)
    return _launch_binary(op, 0, 0, None, a, b, _ew.binary_output(a, b))


def _binary_backward(op, grad, input, other, order=1, partial=0):
    _ew.check_binary_backward(op, grad, input, other, order, partial)
    _check_runnable(f"{op}_backward", input)
    out = _ew.binary_output(grad, input, other)
    return _launch_binary(op, order, partial, grad, input, other, out)


def _binary_gradients(op, grad, input, other):
    _ew.check_binary_gradient_operands(op, f"{op}_gradients", grad, input, other)
    _check_runnable(f"{op}_gradients", input)
    grad_a = _ew.binary_output(grad, input, other)
    grad_b = torch.empty_like(grad_a)
    _launch_binary(op, 1, 0, grad, input, other, grad_a, grad_b)
    return grad_a, grad_b


# pow, pow_backward, pow_gradients, ..., xlog1py_gradients: one function per op, named as the op.
globals().update(_ew.binary_kernels(_binary, _binary_backward, _binary_gradients))
