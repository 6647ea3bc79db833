"""Triton kernels of the elementwise family: the unary ops sqrt, log, log1p, acos,
asin and their <op>_backward, mirroring csrc/include/nanfree/elementwise_math.h
by name (value, derivative, second derivative per op, chain_rule,
unary_element), one launcher per op named as the op.

Inputs are flat: dense tensors of one layout are read as they are (the output
takes their strides), others as contiguous copies. Elements are computed in
the accumulation dtype (float32 for float16 and bfloat16) and rounded once.

The C library functions come from libdevice when compiled. Triton's
interpreter has no libdevice: there log1p, asin and acos are evaluated in
float64 from functions it has (numpy's log, sin and cos): log1p by
log(1 + x) * (x / ((1 + x) - 1)), asin by Newton's method on sin after the
reduction asin(x) = pi/2 - 2 asin(sqrt((1 - |x|) / 2)) for |x| > 1/2 (where
1 - |x| is exact), acos from asin by the matching identities.
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
from .numerics import COMPILED, largest_finite, nf_log, nf_sqrt

_BLOCK = 1024
_HALF_PI = tl.constexpr(1.5707963267948966)
_PI = tl.constexpr(3.141592653589793)


# --- the C library's functions ------------------------------------------------------


@triton.jit
def nf_log1p(x):
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
    # beyond the range (an infinite d or g): +-bound; NaN fails both tests and stays.
    return tl.where(masked > bound, bound, tl.where(masked < -bound, -bound, masked))


@triton.jit
def unary_element(g, x, bound, OP: tl.constexpr, ORDER: tl.constexpr):
    if ORDER == 0:
        return unary_function(x, OP, 0)
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


KERNELS = common.KernelSet(_unary_kernel)
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
            ORDER=order, ACC=_TL_ACC[acc], BLOCK=_BLOCK)
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
